"""The ops backend: every computation a layer hands off, chosen once when the model is built or moved.

`TorchOps` is the torch form of each op: CPU models, float32 models (the reference setup) and training. It is the
reference every kernel is tested against. `TritonOps` (triton_ops.py) overrides the ops its kernels serve, for
bfloat16/float16 models on CUDA/ROCm devices (triton_ops.py says which overrides fall back to the torch form for
shapes their kernel does not take). A layer never asks which backend runs: it calls `step.ops`.

Two kinds of op:
- row-wise (`linear`, `shared_linear`, the norms, `rotate`, the hyper-connection's `update_and_norm` and
  `mix_streams`, `route`, `experts`, `table_rows`): a row's result depends on that row alone; `step` is passed
  where a decode step's few rows take other kernels than a chunk's many;
- per phase (`causal_conv`, `delta_rule`, `ngram_embedding`, `qsa_attention`): what a prompt chunk of one
  sequence and a decode step over N rows do differently with the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import conv, delta_rule, hyper, moe, qsa
from .quantized import QuantizedStack
from .rope import apply_rotary


class TorchOps:
    name = "torch"

    # ---- row-wise --------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedStack, step) -> torch.Tensor:
        """x @ weight.T: the projections a layer makes (docs/ARCHITECTURE.md lists the weights read otherwise); a
        weight kept as GGML blocks multiplies as its dense twin."""
        if isinstance(weight, QuantizedStack):
            weight = weight.dequantize()
        return F.linear(x, weight)

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
        return F.linear(x, torch.cat(rows)).split(sizes, dim=-1)

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        return norm(x)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, norm) -> torch.Tensor:
        return norm(x, gate)

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
                    gate_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper.mix_streams(down, up_weight, normed, hc, gate_logits)

    def route(self, logits: torch.Tensor, top_k: int, normalize: bool, step) -> tuple[torch.Tensor, torch.Tensor]:
        return moe.route(logits, top_k, normalize)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: moe.Experts,
                shared: tuple[torch.Tensor, torch.Tensor], step) -> torch.Tensor:
        """The routed experts' sum plus sigmoid(shared gate logit) * the shared expert's output. A decode step
        gives idle rows no routed part."""
        if step.decode:
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
