"""The Gated DeltaNet sublayer (`linear_attn`): projections, causal depthwise conv, the gated delta rule
and the gated output norm. The four input projections (qkv, z, b, a) run as one product (shared_input.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..state import DeltaNetState
from .config import ModelConfig
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

    def forward(self, x: torch.Tensor, step, state: DeltaNetState) -> torch.Tensor:
        """x [T, H] -> [T, H]; advances the conv and recurrent state (a chunk's sequence, or each active row)."""
        ops, n = step.ops, x.shape[0]
        qkv, z, b, a = self.project_input(x, step)
        mixed = ops.causal_conv(qkv, self.conv1d.weight, 1, state.conv, step)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, self.k_heads, self.dk), k.reshape(n, self.k_heads, self.dk)
        v = v.reshape(n, self.v_heads, self.dv)
        core = ops.delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, state.recurrent, step)
        core = ops.gated_rms_norm(core.reshape(n * self.v_heads, self.dv), z.reshape(n * self.v_heads, self.dv),
                                  self.norm)
        return ops.linear(core.reshape(n, self.value_dim), self.out_proj.weight, step)
