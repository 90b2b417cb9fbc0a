"""A verify step's ops: several decode steps of every state row in one forward (speculative decoding).

A verify step holds `substeps` positions per state row, rows position-major (step.py). A row-wise op (the
projections, norms, routing, experts, hyper-connections) takes all of them at once, so the weights are read once for
every position; it must give each row the numbers that row gets in a plain decode step, which holds where the
backend's products are row-independent (ops.py). A per-phase op (conv, the delta rule, the n-gram context, QSA
selection and attention) runs sub-step by sub-step, each at the decode step's own shape over the same state, so
sub-step j sees exactly the state that j plain decode steps would have left; or, where the backend lists it in
`whole_verify_ops`, its kernels take every sub-step in one launch, each sub-step's rows computed as the decode
step's kernel computes them (the Triton backend's delta rule and convs hold a row's state from one sub-step to the
next; QSA attention needs no carried state: each row reads its state row's K/V and blocks, written for every
position before it runs, through its own list of earlier tokens). The carried state after each sub-step but the
last goes to the state batch's history, from which `StateBatch.commit` keeps, per row, the state after its last
accepted position: rejected positions leave no trace. (K/V and indexer keys are written by position; a rejected
position's are past the row's length and are written again before they are read.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class SubstepOps:
    """The base ops, with the per-phase ops run sub-step by sub-step."""

    def __init__(self, base):
        self.base = base
        self.name = base.name

    def __getattr__(self, name: str):          # row-wise ops: the base's, over every row at once
        return getattr(self.base, name)

    def causal_conv(self, x, weight, dilation, kept, step):
        if "causal_conv" in self.base.whole_verify_ops:
            return self.base.causal_conv(x, weight, dilation, kept, step)
        return each_substep(step, lambda view, x: self.base.causal_conv(x, weight, dilation, kept, view), [x],
                            [kept])

    def delta_rule(self, q, k, v, a, b, a_log, dt_bias, recurrent, step):
        if "delta_rule" in self.base.whole_verify_ops:
            return self.base.delta_rule(q, k, v, a, b, a_log, dt_bias, recurrent, step)
        return each_substep(step, lambda view, *rows: self.base.delta_rule(*rows, a_log, dt_bias, recurrent, view),
                            [q, k, v, a, b], [recurrent])

    def ngram_embedding(self, embedding, step, context_ids):
        return each_substep(step, lambda view: self.base.ngram_embedding(embedding, view, context_ids), [],
                            [context_ids])

    def qsa_attention(self, attn, q, index_q, step, state):
        if "qsa_attention" in self.base.whole_verify_ops:
            return self.base.qsa_attention(attn, q, index_q, step, state)
        return each_substep(step, lambda view, q, index_q: self.base.qsa_attention(attn, q, index_q, view, state),
                            [q, index_q], [])


def each_substep(step, run: Callable, rows: Sequence[torch.Tensor], carried: Sequence[torch.Tensor] = ()
                 ) -> torch.Tensor:
    """run(sub-step view, its slice of each of `rows`) per sub-step in order, concatenated; the `carried` tensors
    (advanced in place by `run`) are kept after every sub-step but the last."""
    views = step.substep_views()
    n = step.token_ids.numel() // len(views)
    outs = []
    for j, view in enumerate(views):
        outs.append(run(view, *(r[j * n:(j + 1) * n] for r in rows)))
        if j < len(views) - 1:
            for tensor in carried:
                step.state.keep(tensor, j)
    return torch.cat(outs)
