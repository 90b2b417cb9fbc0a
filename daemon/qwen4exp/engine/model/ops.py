"""The ops backend: every computation a layer hands off, chosen once when the model is built or moved.

`TorchOps` is the torch form of each op: CPU models, float32 models (the reference setup) and training. It is the
reference every kernel is tested against. `TritonOps` (triton_ops.py) overrides the ops its kernels serve, for
bfloat16/float16 models on CUDA/ROCm devices (triton_ops.py says which overrides fall back to the torch form for
shapes their kernel does not take). A layer never asks which backend runs: it calls `step.ops`.

Two kinds of op:
- row-wise (`linear`, `shared_linear`, the norms, `rotate`, the hyper-connection's `update_and_norm` and
  `mix_streams`, `route`, `experts`, `table_rows`): a row's result depends on that row alone; `step` is passed
  where a decode step's few rows take other kernels than a chunk's many;
- per phase (`causal_conv`, `delta_rule`, `ngram_embedding`, `complete_blocks`, `qsa_attention`): what a prompt
  chunk of one sequence and a decode step over N rows do differently with the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import hot_experts
from . import conv, delta_rule, hyper, moe, qsa
from .quantized import QuantizedStack
from .rope import apply_rotary


# Where a verify step runs its positions together (rows_independent), a decode or verify step's products run in
# GEMMs of exactly this many rows (the last one padded). A CPU BLAS sums a row differently for other row counts (a
# lone row takes a matrix-vector path; below ~4 rows and a short input, another kernel), but within one fixed shape
# a row's result depends on that row alone. So each row of a step sums alike whatever the step's row count: a
# verify step's positions (verify.py) get a plain step's numbers. Elsewhere the padding would only cost time (a
# third of the embedded model's one-slot decode speed).
DECODE_ROW_BLOCK = 16


def decode_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T in GEMMs of DECODE_ROW_BLOCK rows."""
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % DECODE_ROW_BLOCK))
    out = [F.linear(block, weight) for block in padded.split(DECODE_ROW_BLOCK)]
    return (out[0] if len(out) == 1 else torch.cat(out))[:rows]


def _simd_free() -> bool:
    """Whether ATen's CPU kernels run without SIMD (ATEN_CPU_CAPABILITY=default): then an element-wise op gives an
    element the same bits wherever it sits. With SIMD, elements in a tensor's scalar tail (past its last whole
    vector) take other code than the vectorized body, and sigmoid, silu or exp may round differently there, so
    a row's numbers depend on how many rows the tensor has."""
    return torch.backends.cpu.get_cpu_capability() == "DEFAULT"


class TorchOps:
    name = "torch"
    # Whether a row's numbers in a step depend on that row alone whatever the step's row count (not only for a
    # fixed count): then a verify step runs its positions' row-wise ops together (verify.py), else sub-step by
    # sub-step, each a plain decode step.
    rows_independent = _simd_free()
    # The per-phase ops that take a whole verify step themselves (its sub-steps one after another, the carried state
    # after each kept in the state batch's history); verify.py runs the others sub-step by sub-step.
    whole_verify_ops: frozenset[str] = frozenset()

    # ---- row-wise --------------------------------------------------------------------------------------
    def _product(self, step):
        return decode_product if step.decode and self.rows_independent else F.linear

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedStack, step) -> torch.Tensor:
        """x @ weight.T: the projections a layer makes (docs/ARCHITECTURE.md lists the weights read otherwise); a
        weight kept as GGML blocks multiplies as its dense twin (a decode step's in fixed row blocks, where the
        verify step runs its positions together)."""
        if isinstance(weight, QuantizedStack):
            weight = weight.dequantize()
        return self._product(step)(x, weight)

    def shared_linear(self, x: torch.Tensor, runs: list, sizes: list[int], step) -> tuple[torch.Tensor, ...]:
        """x times each weight of a shared input (shared_input.py: `runs` of (stack, the weights' positions),
        `sizes` each weight's rows in input order) -> their products in input order. The torch form multiplies
        the dense twin of all the weights at once, so a GGUF that mixes block types and float tensors in one
        module sums as the single stack of its float twin does."""
        if len(runs) == 1:
            return self.linear(x, runs[0][0], step).split(sizes, dim=-1)
        rows: list[torch.Tensor | None] = [None] * len(sizes)
        for stack, members in runs:
            dense = stack.dequantize() if isinstance(stack, QuantizedStack) else stack
            for i, part in zip(members, dense.split([sizes[i] for i in members])):
                rows[i] = part
        return self._product(step)(x, torch.cat(rows)).split(sizes, dim=-1)

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        return norm(x)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, norm) -> torch.Tensor:
        return norm(x, gate)

    def gate_product(self, x: torch.Tensor, gate: torch.Tensor, silu: bool) -> torch.Tensor:
        """act(gate) * x for x, gate [rows, ...] -> [rows, the rest flattened], act silu (a SwiGLU's input to its
        down projection) or sigmoid (QSA's output gate)."""
        gate = gate.reshape(gate.shape[0], -1)
        return (F.silu(gate) if silu else torch.sigmoid(gate)) * x.reshape(x.shape[0], -1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin)

    def update_and_norm(self, streams: torch.Tensor, norm, add: torch.Tensor | None = None,
                        inject: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams + add, or with the sublayer output injected; its per-stream norm)."""
        if add is not None:
            streams = streams + add
        elif inject is not None:
            streams = hyper.inject(streams, *inject)
        return streams, self.rms_norm(streams, norm)

    def mix_streams(self, down: torch.Tensor, up_weight: torch.Tensor, normed: torch.Tensor, hc: int,
                    gate_logits: torch.Tensor | None, step) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper.mix_streams(down, up_weight, normed, hc, gate_logits, self._product(step))

    def route(self, logits: torch.Tensor, top_k: int, normalize: bool, step) -> tuple[torch.Tensor, torch.Tensor]:
        return moe.route(logits, top_k, normalize)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: moe.Experts,
                shared: tuple[torch.Tensor, torch.Tensor], step) -> torch.Tensor:
        """The routed experts' sum plus sigmoid(shared gate logit) * the shared expert's output. A decode step
        gives idle rows no routed part."""
        if step.decode and experts.hot is not None:
            routed = hot_experts.experts_per_row(x, ids, weights, experts, step.active)
        elif step.decode:
            routed = moe.experts_per_row(x, ids, weights, experts.gate_up_proj, experts.down_proj, step.active)
        else:
            routed = moe.experts_grouped(x, ids, weights, experts.gate_up_proj, experts.down_proj)
        return routed + torch.sigmoid(shared[1]) * shared[0]

    def chunks_experts(self, moe_block: moe.SparseMoeBlock, mixed: list[torch.Tensor], steps: list
                       ) -> list[torch.Tensor]:
        """The MoE block over each of several prompt chunks' inputs (of several sequences, in one forward). The
        torch form runs each chunk's alone: a product's sums may depend on how many rows it multiplies, and a
        chunk's numbers must be the ones it gets alone."""
        return [moe_block(x, step) for x, step in zip(mixed, steps)]

    # ---- per phase ------------------------------------------------------------------------------------
    def causal_conv(self, x: torch.Tensor, weight: torch.Tensor, dilation: int, kept: torch.Tensor,
                    step) -> torch.Tensor:
        """silu(causal depthwise conv) of the new inputs over each sequence's kept inputs, which move on."""
        if step.decode:
            return conv.causal_conv_step(kept, x, weight, dilation, step.active)
        return conv.causal_conv_chunk(kept, x, weight, dilation)

    def delta_rule(self, q, k, v, a, b, a_log, dt_bias, recurrent: torch.Tensor, step) -> torch.Tensor:
        """The gated delta rule from the raw gate projections a/b; advances the recurrent state."""
        if step.decode:
            return delta_rule.gated_delta_rule_rows(q, k, v, a, b, a_log, dt_bias, step.active, recurrent)
        g, beta = delta_rule.gates(a, b, a_log, dt_bias)
        return delta_rule.gated_delta_rule(q, k, v, g, beta, recurrent)

    def ngram_embedding(self, embedding, step, context_ids: torch.Tensor) -> torch.Tensor:
        """PLE's hashed n-gram embeddings of the step's tokens; advances each sequence's id context."""
        if step.decode:
            return embedding.step_rows(step.token_ids, context_ids, step.active, self.table_rows)
        return embedding.chunk_rows(step.token_ids, context_ids, self.table_rows)

    def table_rows(self, table: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """Rows of an embedding table (an nn.Embedding, or a QuantizedStack dequantizing the rows it reads)."""
        return table(rows)

    def complete_blocks(self, indexer: qsa.Indexer, step, state) -> None:
        """decode: the indexer key of the block each active row's token completes (if it does) into the state's
        block keys, its raw keys stored."""
        indexer.complete_blocks(step, state)

    def qsa_attention(self, attn: qsa.QSAAttention, q: torch.Tensor, index_q: torch.Tensor, step,
                      state) -> torch.Tensor:
        """Each query's selected tokens' attention [T, heads * head_dim], K/V and indexer keys already stored:
        in a chunk a mask over the prefix (dense where every token is still selected), in decode the gathered
        tokens of each row's list, in float32."""
        if step.decode:
            index, valid = attn.indexer.rows_token_lists(index_q, step.positions, state)
            return qsa.attend_rows(q, state.keys, state.values, index, valid, attn.head_dim ** -0.5)
        selected = attn.indexer.select_mask(index_q, step.start, state)
        return qsa.attend_chunk(q, state.keys, state.values, selected, step.start, attn.head_dim ** -0.5)


TORCH_OPS = TorchOps()
