"""The MoE router as one Triton kernel (CUDA and ROCm): softmax, top-k, renormalisation.

In torch the router is four to six kernels a layer (softmax, top-k, sum, division, cast); a decode step of a few
rows and a short prompt chunk are both bound by their launches, not by this work. Here one program per row holds
the row's expert logits (512 on the shipped model) in registers, takes the k largest probabilities one at a time
(ties to the lower expert id, as a stable sort would) and writes ids and weights.

Numerics: float32 throughout as in torch's router (softmax in float32, weights divided by their float32 sum,
rounded once to the model dtype); the exponential and the order inside the sums are the kernel's own, so a
weight can differ from the torch form's in its last bit. Every bf16/fp16 decode step and prompt chunk on a GPU
takes this kernel (float32 models keep torch's router); a row's choice depends on its own logits alone, so
results do not depend on the batch, the graph or the snapshot they came from.
"""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton

MAX_EXPERTS = 4096   # one row's logits live in registers


def fits(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these router logits [T, E]: E within one row's registers."""
    return logits.dim() == 2 and logits.shape[-1] <= MAX_EXPERTS


if triton is not None:
    from .rounding import round_to

    @triton.jit
    def _route_kernel(logits_ptr, logits_stride, ids_ptr, weights_ptr, experts, K: tl.constexpr,
                      NORMALIZE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        ok = cols < experts
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=ok, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        probs = tl.where(ok, e / tl.sum(e, axis=0), -1.0)    # below every probability: never chosen
        slots = tl.arange(0, BLOCK_K)
        chosen_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
        for slot in tl.static_range(K):
            best = tl.max(probs, axis=0)
            # (a row of NaN logits, an idle row's, matches nothing: it gets the last expert, never past it)
            expert = tl.minimum(tl.min(tl.where(probs == best, cols, BLOCK_E), axis=0), experts - 1)
            chosen_ids = tl.where(slots == slot, expert, chosen_ids)
            chosen = tl.where(slots == slot, best, chosen)
            probs = tl.where(cols == expert, -1.0, probs)
        if NORMALIZE:
            chosen = chosen / tl.sum(chosen, axis=0)
        tl.store(ids_ptr + row * K + slots, chosen_ids, mask=slots < K)
        tl.store(weights_ptr + row * K + slots, round_to(chosen, weights_ptr.dtype.element_ty, INTERPRETED),
                 mask=slots < K)


def route_rows(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (expert ids [T, k] int64, weights [T, k] in the logits' dtype), as Router.forward."""
    rows, experts = logits.shape
    if not 0 < top_k <= experts or experts > MAX_EXPERTS:
        raise ValueError(f"the router kernel takes 1 <= top_k <= experts <= {MAX_EXPERTS}: got top_k {top_k} "
                         f"of {experts} experts")
    ids = torch.empty(rows, top_k, device=logits.device, dtype=torch.int64)
    weights = torch.empty(rows, top_k, device=logits.device, dtype=logits.dtype)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _route_kernel[(rows,)](logits, logits.stride(0), ids, weights, experts, K=top_k, NORMALIZE=normalize,
                               INTERPRETED=interpreted(logits), BLOCK_E=triton.next_power_of_2(experts),
                               BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return ids, weights
