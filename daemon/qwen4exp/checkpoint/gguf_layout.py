"""llama.cpp's GGUF layout of qwen4_exp (architecture "qwen4exp"): the metadata keys and the tensors, mapped to ours.

One table says, for every GGUF tensor, which part of which runtime tensor it fills and how the values differ:
llama.cpp's converter stores the zero-centred norms as 1 + w, A_log as A = -exp(A_log), a Gated DeltaNet's value
heads tiled by key head instead of grouped, the conv weights without their singleton axis, the indexer's
query and key projections apart, the experts as 3-D stacks of gate, up and down, and the PLE hash constants as
metadata. Reading applies each transform backwards, writing forwards. Names, keys and transforms were checked
against the converter vendored in llama.cpp (conversion/qwen4exp.py) on the tiny preset: every tensor the same,
bit for bit in float32 (tests/test_gguf.py reads a file that converter wrote).

What GGUF does not carry: the MTP head (the converter drops it), the Gated DeltaNet output gate's activation
(llama.cpp hard-codes one; we keep the published config's silu), norm_topk_prob (llama.cpp always normalises).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..engine.model.config import LINEAR, ModelConfig


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclasses.dataclass(frozen=True)
class Piece:
    """A GGUF tensor and the part of a runtime tensor it fills: target[rows] (all of it when rows is None),
    read through `from_gguf` and written through `to_gguf` (both on float32 tensors in torch's axis order).
    `blocks`: the same reorder on a quantized tensor's blocks (uint8 [rows, row bytes], the block type's
    (values, bytes) and the direction given), for a piece whose transform moves whole blocks; it answers None
    where it would split a block (the piece is then read dense)."""
    gguf: str
    target: str
    rows: slice | None = None          # along the target's axis `axis`
    axis: int = 0
    from_gguf: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    to_gguf: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    float32: bool = False              # llama.cpp keeps it in F32 whatever the file's type
    blocks: Callable[[torch.Tensor, tuple[int, int], bool], torch.Tensor | None] | None = None

    def reorder_blocks(self, raw: torch.Tensor, layout: tuple[int, int], to_gguf: bool = False
                       ) -> torch.Tensor | None:
        """`raw` blocks (uint8 [rows, row bytes] of a type of `layout` (values, bytes) a block) in our order (from
        the file's, or to it with `to_gguf`), or None when this piece's values cannot be kept as the file's
        blocks."""
        if self.from_gguf is _unchanged:
            return raw
        return None if self.blocks is None else self.blocks(raw, layout, to_gguf)

    def part_of(self, target: torch.Tensor) -> torch.Tensor:
        """The part of the runtime tensor `target` this GGUF tensor fills (a view)."""
        if self.rows is None:
            return target
        return target.narrow(self.axis, self.rows.start, self.rows.stop - self.rows.start)


def _offset_norm(gguf: str, target: str) -> Piece:
    """A zero-centred RMSNorm weight w, stored as 1 + w in F32."""
    return Piece(gguf, target, from_gguf=lambda g: g - 1.0, to_gguf=lambda w: w + 1.0, float32=True)


def _heads(cfg: ModelConfig, width: int) -> tuple[Callable, Callable]:
    """(grouped -> tiled, tiled -> grouped) reorders of the Gated DeltaNet's value heads along axis 0, each head
    `width` wide: ours (as the published checkpoint) keeps the value heads of key head g together (head g*R + r),
    llama.cpp's converter tiles them (head r*nk + g)."""
    nk, repeats = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads

    def tiled(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(nk, repeats, width, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(repeats, nk, width, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    return tiled, grouped


def _value_rows(cfg: ModelConfig, first: int) -> tuple[Callable, Callable]:
    """Reorders of rows [first:] by value head (rows before `first`, q and k, stay)."""
    tiled, grouped = _heads(cfg, cfg.linear_value_head_dim)
    return (lambda t: torch.cat((t[:first], tiled(t[first:]))),
            lambda t: torch.cat((t[:first], grouped(t[first:]))))


def _row_blocks(to_gguf: Callable, from_gguf: Callable) -> Callable:
    """`Piece.blocks` of a reorder of whole rows: the same reorder on the rows of blocks."""
    return lambda raw, layout, forward: (to_gguf if forward else from_gguf)(raw)


def _column_head_blocks(cfg: ModelConfig) -> Callable:
    """`Piece.blocks` of the Gated DeltaNet output's reorder of its input columns by value head: whole blocks
    move where a head's width is a multiple of the block's values."""
    width = cfg.linear_value_head_dim

    def reorder(raw: torch.Tensor, layout: tuple[int, int], forward: bool) -> torch.Tensor | None:
        values, size = layout
        if width % values:
            return None
        by_block = raw.reshape(raw.shape[0], -1, size).transpose(0, 1)     # [blocks along a row, rows, bytes]
        tiled, grouped = _heads(cfg, width // values)
        return (tiled if forward else grouped)(by_block).transpose(0, 1).reshape(raw.shape)

    return reorder


def layer_pieces(cfg: ModelConfig, i: int) -> list[Piece]:
    """The GGUF tensors of decoder layer i."""
    blk, ours = f"blk.{i}.", f"model.layers.{i}."
    pieces = []
    for gguf_hc, ours_hc in (("hc_attn", "attn_hyper_connection"), ("hc_ffn", "mlp_hyper_connection")):
        pieces += [_offset_norm(f"{blk}{gguf_hc}_norm.weight", f"{ours}{ours_hc}.hc_norm.weight"),
                   Piece(f"{blk}{gguf_hc}_down.weight", f"{ours}{ours_hc}.input_mix_weight_down.weight"),
                   Piece(f"{blk}{gguf_hc}_up.weight", f"{ours}{ours_hc}.input_mix_weight_up.weight"),
                   Piece(f"{blk}{gguf_hc}_inject.weight", f"{ours}{ours_hc}.block_inject_weight.weight")]
    inter = cfg.moe_intermediate_size
    mlp = f"{ours}mlp."
    pieces += [Piece(f"{blk}ffn_gate_inp.weight", f"{mlp}gate.weight", float32=True),
               Piece(f"{blk}ffn_gate_exps.weight", f"{mlp}experts.gate_up_proj", slice(0, inter), axis=1),
               Piece(f"{blk}ffn_up_exps.weight", f"{mlp}experts.gate_up_proj", slice(inter, 2 * inter), axis=1),
               Piece(f"{blk}ffn_down_exps.weight", f"{mlp}experts.down_proj"),
               Piece(f"{blk}ffn_gate_shexp.weight", f"{mlp}shared_expert.gate_proj.weight"),
               Piece(f"{blk}ffn_up_shexp.weight", f"{mlp}shared_expert.up_proj.weight"),
               Piece(f"{blk}ffn_down_shexp.weight", f"{mlp}shared_expert.down_proj.weight"),
               Piece(f"{blk}ffn_gate_inp_shexp.weight", f"{mlp}shared_expert_gate.weight", float32=True)]
    if cfg.layer_types[i] == LINEAR:
        pieces += _deltanet_pieces(cfg, blk, f"{ours}linear_attn.")
    else:
        pieces += _qsa_pieces(cfg, blk, f"{ours}self_attn.")
    if i + 1 in cfg.ple_layer_ids:
        ple = f"{ours}ple."
        pieces += [Piece(f"{blk}ple_key.weight", f"{ple}key_proj.weight"),
                   Piece(f"{blk}ple_value.weight", f"{ple}value_proj.weight"),
                   _offset_norm(f"{blk}ple_norm_key.weight", f"{ple}norm_key.weight"),
                   _offset_norm(f"{blk}ple_norm_query.weight", f"{ple}norm_query.weight"),
                   _offset_norm(f"{blk}ple_norm_conv.weight", f"{ple}norm_conv.weight"),
                   Piece(f"{blk}ple_conv1d.weight", f"{ple}conv1d.weight", from_gguf=lambda t: t.unsqueeze(1),
                         to_gguf=lambda t: t.squeeze(1)),
                   Piece("per_layer_token_embd.weight", f"{ple}ple_embedding.ngram_embedding.weight")]
    return pieces


def _deltanet_pieces(cfg: ModelConfig, blk: str, ours: str) -> list[Piece]:
    qk = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    to_rows, from_rows = _value_rows(cfg, qk)
    to_heads, from_heads = _heads(cfg, cfg.linear_value_head_dim)
    to_one, from_one = _heads(cfg, 1)
    return [
        Piece(f"{blk}attn_qkv.weight", f"{ours}in_proj_qkv.weight", from_gguf=from_rows, to_gguf=to_rows,
              blocks=_row_blocks(to_rows, from_rows)),
        Piece(f"{blk}attn_gate.weight", f"{ours}in_proj_z.weight", from_gguf=from_heads, to_gguf=to_heads,
              blocks=_row_blocks(to_heads, from_heads)),
        Piece(f"{blk}ssm_beta.weight", f"{ours}in_proj_b.weight", from_gguf=from_one, to_gguf=to_one,
              blocks=_row_blocks(to_one, from_one)),
        Piece(f"{blk}ssm_alpha.weight", f"{ours}in_proj_a.weight", from_gguf=from_one, to_gguf=to_one,
              blocks=_row_blocks(to_one, from_one)),
        Piece(f"{blk}ssm_a", f"{ours}A_log", from_gguf=lambda a: torch.log(-from_one(a)),
              to_gguf=lambda a_log: -torch.exp(to_one(a_log)), float32=True),
        Piece(f"{blk}ssm_dt.bias", f"{ours}dt_bias", from_gguf=from_one, to_gguf=to_one, float32=True),
        Piece(f"{blk}ssm_conv1d.weight", f"{ours}conv1d.weight", from_gguf=lambda t: from_rows(t).unsqueeze(1),
              to_gguf=lambda t: to_rows(t.squeeze(1)), float32=True),
        Piece(f"{blk}ssm_norm.weight", f"{ours}norm.weight", float32=True),   # a plain gamma: no offset
        Piece(f"{blk}ssm_out.weight", f"{ours}out_proj.weight", from_gguf=lambda t: from_heads(t.T).T,
              to_gguf=lambda t: to_heads(t.T).T, blocks=_column_head_blocks(cfg)),
    ]


def _qsa_pieces(cfg: ModelConfig, blk: str, ours: str) -> list[Piece]:
    queries = cfg.indexer_n_heads * cfg.indexer_head_dim
    return [
        Piece(f"{blk}attn_q.weight", f"{ours}q_proj.weight"),
        Piece(f"{blk}attn_k.weight", f"{ours}k_proj.weight"),
        Piece(f"{blk}attn_v.weight", f"{ours}v_proj.weight"),
        Piece(f"{blk}attn_output.weight", f"{ours}o_proj.weight"),
        _offset_norm(f"{blk}attn_q_norm.weight", f"{ours}q_norm.weight"),
        _offset_norm(f"{blk}attn_k_norm.weight", f"{ours}k_norm.weight"),
        Piece(f"{blk}indexer.q_proj.weight", f"{ours}indexer.index_qk_proj.weight", slice(0, queries)),
        Piece(f"{blk}indexer.k_proj.weight", f"{ours}indexer.index_qk_proj.weight",
              slice(queries, queries + cfg.indexer_head_dim)),
        _offset_norm(f"{blk}indexer.q_norm.weight", f"{ours}indexer.q_layernorm.weight"),
        _offset_norm(f"{blk}indexer.k_norm.weight", f"{ours}indexer.k_layernorm.weight"),
    ]


def pieces(cfg: ModelConfig) -> list[Piece]:
    """Every tensor of the model in llama.cpp's layout (the MTP head has none)."""
    mixer = "model.hyper_connection_mixer."
    out = [Piece("token_embd.weight", "model.embed_tokens.weight"),
           Piece("output.weight", "lm_head.weight"),
           _offset_norm("output_hc_norm.weight", f"{mixer}hc_norm.weight"),
           Piece("output_hc_down.weight", f"{mixer}input_mix_weight_down.weight"),
           Piece("output_hc_up.weight", f"{mixer}input_mix_weight_up.weight")]
    for i in range(cfg.num_hidden_layers):
        out += layer_pieces(cfg, i)
    return out


def ple_constants_from(model: torch.nn.Module) -> dict[str, list[int]]:
    """The PLE hash constants the model hashes with, under llama.cpp's metadata keys."""
    names = {"layer_multipliers": "ple.layer_multipliers", "ngram_heads_offsets": "ple.head_offsets",
             "ngram_heads_vocab_sizes": "ple.head_vocab_sizes"}
    return {names[name.rsplit(".", 1)[1]]: [int(v) for v in buffer.tolist()]
            for name, buffer in model.named_buffers()
            if name.startswith("model.") and name.rsplit(".", 1)[1] in names}
