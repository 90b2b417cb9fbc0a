"""The multi-token-prediction head shipped under `mtp.*`.

It fuses the embedding of the next token with the main model's pre-mixer streams (each normalised,
then projected by fc_embedding / fc_hidden), runs one QSA + MoE decoder layer with hyper-connections
and collapses the streams with its own mixer for the shared LM head. This issue loads its weights;
drafting with it is the speculative-decoding work.
"""

from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .decoder import DecoderLayer, hyper_connection
from .norms import RMSNorm


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
