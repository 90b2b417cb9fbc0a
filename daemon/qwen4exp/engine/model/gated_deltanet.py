"""The Gated DeltaNet sublayer (`linear_attn`): projections, causal depthwise conv, the gated delta rule
and the gated output norm. The four input projections (qkv, z, b, a) run as one product (shared_input.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..state import DeltaNetState
from .config import ModelConfig
from .conv_step import causal_conv_chunk, causal_conv_step
from .gdn_ops import gated_delta_rule, gated_delta_rule_rows, gates
from .norms import GatedRMSNorm
from .shared_input import SharedInputProjections


class GatedDeltaNet(SharedInputProjections):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        hidden = cfg.hidden_size
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=cfg.linear_conv_kernel_dim, groups=conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, cfg.gdn_gate_activation)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.v_heads, bias=False)
        self.stack_input_weights()

    def input_weights(self) -> list[nn.Parameter]:
        return [self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight, self.in_proj_a.weight]

    def forward(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """x [n, H] of one sequence -> [n, H]; advances the conv and recurrent state."""
        n = x.shape[0]
        qkv, z, b, a = self.project_input(x)
        mixed = causal_conv_chunk(state.conv, qkv, self.conv1d.weight, 1)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, self.k_heads, self.dk), k.reshape(n, self.k_heads, self.dk)
        v = v.reshape(n, self.v_heads, self.dv)
        g, beta = gates(a, b, self.A_log, self.dt_bias)
        core = gated_delta_rule(q, k, v, g, beta, state.recurrent)
        z = z.reshape(n * self.v_heads, self.dv)
        core = self.norm(core.reshape(n * self.v_heads, self.dv), z)
        return self.out_proj(core.reshape(n, self.value_dim))

    def decode_rows(self, x: torch.Tensor, state: DeltaNetState, active: torch.Tensor) -> torch.Tensor:
        """One token for each of N sequences: x [N, H], state batched (conv [N, C, K-1], recurrent
        [N, Hv, dk, dv]); only rows with `active` (bool or uint8) advance their state."""
        n = x.shape[0]
        qkv, z, b, a = self.project_input(x)
        mixed = causal_conv_step(state.conv, qkv, self.conv1d.weight, 1, active)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, self.k_heads, self.dk), k.reshape(n, self.k_heads, self.dk)
        v = v.reshape(n, self.v_heads, self.dv)
        core = gated_delta_rule_rows(q, k, v, a, b, self.A_log, self.dt_bias, active, state.recurrent)
        z = z.reshape(n * self.v_heads, self.dv)
        core = self.norm(core.reshape(n * self.v_heads, self.dv), z)
        return self.out_proj(core.reshape(n, self.value_dim))
