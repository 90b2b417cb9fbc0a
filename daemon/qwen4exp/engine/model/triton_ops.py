"""The Triton backend: the kernels of daemon/qwen4exp/kernels for bfloat16/float16 models on CUDA/ROCm devices.

Chosen by backend.ops_for when guard.serves the model's device and dtype. Each override keeps its torch form's
contract and rounding points (the kernels' tests hold them to it). Where a kernel takes only some shapes (rope,
the mix, the router, row products, QSA), the override falls back to the torch form for the others; the other
kernels refuse a shape they cannot take with an error. Which form runs depends on the shapes alone, never on
the data, so every step of an engine sums alike.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from ...kernels import conv as conv_kernels
from ...kernels import delta_rule as delta_rule_kernels
from ...kernels import gate_product as gate_product_kernels
from ...kernels import block_keys, block_products, gated_norm, hyper, moe, qsa_attention, qsa_select, quant_tiles
from ...kernels import ngram_rows, rope, router
from ...kernels import row_products
from .. import hot_experts
from . import conv, delta_rule, qsa, verify
from .ops import TorchOps
from .quantized import QuantizedStack


class TritonOps(TorchOps):
    name = "triton"
    # A verify step (model/verify.py) runs its positions' row-wise ops together, each product's rows as plain decode
    # steps compute them (`_as_plain_steps`): its positions get plain steps' numbers, and a plain step runs as it
    # does without speculative decoding.
    rows_independent = True
    # The per-phase ops whose kernels run a verify step's sub-steps in one launch, keeping the state after each.
    whole_verify_ops = frozenset({"causal_conv", "delta_rule", "qsa_attention"})

    def linear(self, x, weight, step):
        if step.decode and step.substeps > 1:
            return _as_plain_steps(x, weight, step.substeps)
        return _plain_product(x, weight, step.decode)

    def _product(self, step):
        # The torch forms' products (the stream mix's where its kernel does not take the sizes) go through `linear`
        # too, so a verify step gives their rows plain steps' numbers as well.
        return functools.partial(self.linear, step=step)

    def shared_linear(self, x, runs, sizes, step):
        # One product per stack (a stack of one block type, or the dense one): the few rows of a decode step read
        # each weight once, as blocks where they are blocks.
        products: list[torch.Tensor | None] = [None] * len(sizes)
        for stack, members in runs:
            for i, part in zip(members, self.linear(x, stack, step).split([sizes[i] for i in members], dim=-1)):
                products[i] = part
        return tuple(products)

    def rms_norm(self, x, norm):
        return hyper.norm_rows(x, norm.weight, norm.eps, norm.group_size or x.shape[-1])[1]

    def gated_rms_norm(self, x, gate, norm):
        return gated_norm.gated_norm(x, gate, norm.weight, norm.eps, norm.silu)

    def gate_product(self, x, gate, silu):
        if not gate_product_kernels.fits(x, gate):
            return super().gate_product(x, gate, silu)
        return gate_product_kernels.gate_product(x, gate, silu)

    def rotate(self, x, cos, sin):
        return rope.rotate(x, cos, sin) if rope.fits(x, cos) else super().rotate(x, cos, sin)

    def update_and_norm(self, streams, norm, add=None, inject=None):
        return hyper.norm_rows(streams, norm.weight, norm.eps, norm.group_size, add, inject)

    def mix_streams(self, down, up_weight, normed, hc, gate_logits, step):
        if not hyper.mix_fits(hc, down.shape[-1]):
            return super().mix_streams(down, up_weight, normed, hc, gate_logits, step)
        return hyper.mix_streams(down, up_weight, normed, hc, gate_logits)

    def route(self, logits, top_k, normalize, step):
        if router.fits(logits):
            return router.route_rows(logits, top_k, normalize)
        return super().route(logits, top_k, normalize, step)

    def experts(self, x, ids, weights, experts, shared, step, form: moe.GroupedForm | None = None):
        if step.decode and experts.hot is not None:
            return hot_experts.moe_rows(x, ids, weights, experts, step.flags, shared)
        if step.decode:
            return moe.moe_rows(x, ids, weights, experts.gate_up_proj, experts.down_proj, step.flags, shared)
        return moe.moe_grouped(x, ids, weights, experts.gate_up_proj, experts.down_proj, form, shared)

    def chunks_experts(self, moe_block, mixed, steps):
        # The routed experts of every chunk in one grouped launch, their weights read once for all: within one
        # form (moe.grouped_form) the grouped kernels' rows do not depend on each other (tests/test_moe_kernels.py),
        # so each chunk's rows come out as they do alone, in the form it takes alone (its own pair count's, whatever
        # the sum). The router and the shared expert, products whose sums may follow the row count, run per chunk;
        # so does every chunk when the chunks' forms differ.
        routed = [moe_block.route(x, step) for x, step in zip(mixed, steps)]
        experts = moe_block.experts
        forms = {moe.grouped_form(experts.gate_up_proj, experts.down_proj, ids.numel()) for _, ids, _, _ in routed}
        if len(forms) > 1:
            return [self.experts(*r[:3], experts, r[3], step) for r, step in zip(routed, steps)]
        x, ids, weights = (torch.cat([r[i] for r in routed]) for i in range(3))
        shared = tuple(torch.cat([r[3][i] for r in routed]) for i in range(2))
        out = self.experts(x, ids, weights, experts, shared, steps[0], form=forms.pop())
        return list(out.split([r[0].shape[0] for r in routed]))

    def ngram_embedding(self, embedding, step, context_ids):
        # The n-gram rows in one launch (kernels/ngram_rows.py: the torch form's rows exactly)
        hash_rows = functools.partial(ngram_rows.ngram_rows, eos=embedding.eos,
                                      multipliers=embedding.layer_multipliers,
                                      sizes=embedding.ngram_heads_vocab_sizes, offsets=embedding.ngram_heads_offsets)
        if step.decode:
            return embedding.step_rows(step.token_ids, context_ids, step.active, self.table_rows, hash_rows)
        return embedding.chunk_rows(step.token_ids, context_ids, self.table_rows, hash_rows)

    def table_rows(self, table, rows):
        # A quantized table's rows dequantized in one launch (bit for bit the torch form's values)
        if isinstance(table, QuantizedStack):
            return quant_tiles.gather_rows(table.blocks, table.qtype, rows, table.dtype)
        return super().table_rows(table, rows)

    def causal_conv(self, x, weight, dilation, kept, step):
        if step.decode and step.substeps > 1:
            return conv_kernels.conv_substeps(kept, step.state.history(kept), x, weight, dilation, step.flags,
                                              step.substeps)
        if step.decode:
            return conv_kernels.conv_step(kept, x, weight, dilation, step.flags)
        out = conv_kernels.conv_chunk(kept, x, weight, dilation)
        conv.keep_last_inputs(kept, x)
        return out

    def delta_rule(self, q, k, v, a, b, a_log, dt_bias, recurrent, step):
        if step.decode and step.substeps > 1:
            return delta_rule_kernels.verify_steps(q, k, v, a, b, a_log, dt_bias, step.flags, recurrent,
                                                   step.state.history(recurrent), step.substeps)
        if step.decode:
            return delta_rule_kernels.decode_step(q, k, v, a, b, a_log, dt_bias, step.flags, recurrent)
        if delta_rule_kernels.runs_token_loop(q.shape[0]):
            return delta_rule_kernels.chunk_tokens(q, k, v, a, b, a_log, dt_bias, recurrent)
        if not delta_rule_kernels.fla_available():
            return super().delta_rule(q, k, v, a, b, a_log, dt_bias, recurrent, step)
        g, beta = delta_rule.gates(a, b, a_log, dt_bias)
        return delta_rule_kernels.fla_chunk(q, k, v, g, beta, recurrent)

    def complete_blocks(self, indexer, step, state):
        # Every row at once, a verify step's sub-steps too: a row's mean is of its own raw keys, and only the rows
        # that complete a block write it (kernels/block_keys.py); the norm and the rotation are row-wise kernels.
        if not block_keys.fits(indexer.dim, indexer.ratio):
            return super().complete_blocks(indexer, step, state)
        ratio = indexer.ratio

        def block_rope():      # the same in every QSA layer of the step: made once
            starts = indexer.last_block(step.positions) * ratio
            return step.cos_table[starts], step.sin_table[starts]
        means = block_keys.block_means(state.index_keys, step.state_rows, step.positions, ratio)
        pooled = self.rotate(self.rms_norm(means, indexer.k_layernorm), *step.shared(("block rope", ratio), block_rope))
        block_keys.store_finished(state.block_keys, step.state_rows, step.positions, step.flags, pooled, ratio)

    def qsa_attention(self, attn, q, index_q, step, state):
        indexer = attn.indexer
        if not qsa_attention.fits(attn.head_dim, attn.heads, attn.kv_heads, indexer.dim, indexer.heads):
            torch_form = functools.partial(TorchOps.qsa_attention, self, attn, state=state)
            if step.decode and step.substeps > 1:      # the torch form takes a verify step's sub-steps one by one
                return verify.each_substep(step, lambda view, q, index_q: torch_form(q, index_q, view), [q, index_q])
            return torch_form(q, index_q, step)
        # A decode step's rows read the batched state (a verify step's sub-steps, rows position-major: row r's
        # state row is r mod N), each through its own index list: all of a verify step's sub-steps in one launch.
        scale = attn.head_dim ** -0.5
        if step.decode:
            complete = step.shared(("complete blocks", indexer.ratio), lambda: (step.positions + 1) // indexer.ratio)
            keys = qsa_attention.rank_blocks(index_q, state.block_keys, complete)
            index, valid = qsa_select.token_lists(keys, complete, step.positions,
                                                  min(indexer.block_topk, state.block_keys.shape[1]), indexer.ratio,
                                                  state.index_keys.shape[1])
            out = qsa_attention.sparse_attention(q, state.keys, state.values, index, valid, scale,
                                                 splits=qsa_attention.DECODE_SPLITS)
        else:
            index, valid = self._chunk_token_lists(indexer, index_q, step, state)
            out = qsa_attention.sparse_attention(q, state.keys, state.values, index, valid, scale)
        return out.reshape(q.shape[0], -1)

    @staticmethod
    def _chunk_token_lists(indexer, index_q: torch.Tensor, step, state) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's tokens as a list (index, valid [n, S], S = budget + ratio): the same tokens as
        Indexer.select_mask, in ascending order; a query's list does not depend on the chunk it comes in. What
        does not depend on the layer (the positions' complete blocks; the whole lists while the chunk is dense) is
        made once per chunk, shared by every QSA layer of the step."""
        n, device = index_q.shape[0], index_q.device
        end = step.start + n
        positions = step.positions
        complete = step.shared(("complete blocks", indexer.ratio), lambda: (positions + 1) // indexer.ratio)
        capacity = state.index_keys.shape[0]
        if end <= indexer.block_topk * indexer.ratio + indexer.ratio - 1:
            # Dense: every query sees fewer than block_topk complete blocks, so ranking would keep them all.
            def dense():
                chosen = torch.arange(indexer.block_topk, device=device).expand(n, -1)
                index, valid = qsa.token_lists(chosen, complete, positions, indexer.ratio, capacity)
                return index.to(torch.int32), valid
            return step.shared(("dense token lists", indexer.ratio, indexer.block_topk, capacity), dense)
        blocks = state.block_keys[:end // indexer.ratio]
        width = (indexer.block_topk + 1) * indexer.ratio
        index = torch.empty(n, width, dtype=torch.int32, device=device)
        valid = torch.empty(n, width, dtype=torch.bool, device=device)
        # The ranking keys ([rows, n_blocks] int64) are the work space that grows with the prefix. Slices start at
        # multiples of 16 rows, so their views of the positions and lists are 16-byte aligned as the warm-up's
        # whole chunk is: Triton builds another binary for a pointer that is not, on a long prompt's path.
        for first, last in qsa.query_slices(n, ranking_slice_rows(blocks.shape[0]), align=SLICE_ALIGN):
            keys = qsa_attention.rank_blocks(index_q[first:last], blocks, complete[first:last])
            qsa_select.token_lists(keys, complete[first:last], positions[first:last], indexer.block_topk,
                                   indexer.ratio, capacity, out=(index[first:last], valid[first:last]))
        return index, valid


SLICE_ALIGN = 16


def ranking_slice_rows(n_blocks: int) -> int:
    """Most queries ranked at once: their int64 keys over `n_blocks` blocks take SCORE_BUDGET_BYTES / 2."""
    return max(qsa.QUERY_SLICE, qsa.SCORE_BUDGET_BYTES // (16 * n_blocks))


TRITON_OPS = TritonOps()


@functools.cache
def with_torch_forms(ops: frozenset[str]) -> TritonOps:
    """The Triton backend with the torch form of each of `ops` (those whose kernels do not build for a GPU:
    guard.NOT_BUILT). The torch forms still call the other ops through this backend."""
    backend = TritonOps()
    # Chunks share the experts' launch only over the grouped kernels, whose rows are independent.
    for op in ops | ({"chunks_experts"} if "experts" in ops else set()):
        setattr(backend, op, types.MethodType(getattr(TorchOps, op), backend))
    backend.whole_verify_ops = TritonOps.whole_verify_ops - ops
    return backend


def _plain_product(x: torch.Tensor, weight, decode: bool) -> torch.Tensor:
    if isinstance(weight, QuantizedStack):
        return block_products.linear(x, weight)
    # A decode step's few rows stream each weight once in row_products' kernel where it beats cuBLAS.
    return row_products.linear(x, weight) if decode else F.linear(x, weight)


def _as_plain_steps(x: torch.Tensor, weight, substeps: int) -> torch.Tensor:
    """A verify step's product, x [S * R, ..., K] holding sub-step after sub-step (R rows each: a slot's row, or its
    streams'), each row what a plain decode step's product over R rows gives it. Where that runs in a kernel whose
    row tile is fixed (block products, the row kernel), a row's sum does not depend on the rows beside it, and the
    rows go 16 at a time (the weight read once per 16 rows); where it runs on cuBLAS, which picks its kernel by the
    row count, each sub-step's rows go on their own, at the plain step's shape. Rows that are not S blocks (the
    drafts' LM head takes a slot's last row) are one block."""
    count = x.shape[0] // substeps if x.shape[0] % substeps == 0 else x.shape[0]
    if _fixed_row_tile(x[:count], weight):
        rows = x.reshape(-1, x.shape[-1])
        out = [_plain_product(block, weight, True) for block in rows.split(row_products.MAX_ROWS)]
        return (out[0] if len(out) == 1 else torch.cat(out)).reshape(*x.shape[:-1], -1)
    out = [_plain_product(block, weight, True) for block in x.split(count)]
    return out[0] if len(out) == 1 else torch.cat(out)


def _fixed_row_tile(x: torch.Tensor, weight) -> bool:
    """Whether a decode step's product of x runs in a kernel whose row tile is MAX_ROWS whatever the rows given."""
    if isinstance(weight, QuantizedStack):
        return block_products.kernel_takes(x)
    return row_products.kernel_takes(x, weight)
