"""The sparse MoE block: softmax router with normalised top-k, routed SwiGLU experts, and a shared
expert behind a sigmoid gate. The router, the shared expert's gate/up and its sigmoid gate read the same
input and run as one product (shared_input.py). The functions below are the torch forms of kernels/router.py
and kernels/moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .shared_input import SharedInputProjections


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, gate: torch.Tensor, up: torch.Tensor, step) -> torch.Tensor:
        """The output given gate_proj(x) and up_proj(x)."""
        return step.ops.linear(step.ops.gate_product(up, gate, silu=True), self.down_proj.weight, step)


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: torch.Tensor, logits: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [T, k], weights [T, k] in x's dtype) from x's product with the weight (x itself is
        passed for the training forward's hooks)."""
        return step.ops.route(logits, self.top_k, self.normalize, step)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


class Experts(nn.Module):
    """All experts' weights as two stacked tensors (gate and up fused)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # A split layer's (engine/hot_experts.py), neither a parameter nor a buffer: they stay where they are put
        # when the module moves. `hot`: copies of its most routed experts on the target; `counts`: pairs routed to
        # each expert by decode steps (prompt chunks too while `count_prompts`), int64 [E] on the layer's device.
        self.hot = None
        self.counts: torch.Tensor | None = None
        self.count_prompts = False


def experts_per_row(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's rows, each through its own k experts as a batch of matrix-vector products over gathered
    expert weights, summed in slot order: a row's result depends only on the row (for a fixed number of rows).
    Rows with active False get zeros. Fixed shapes and no host synchronisation (a CUDA graph holds it)."""
    return sum_slots(pair_outputs(x.repeat_interleave(ids.shape[1], dim=0), ids.reshape(-1), gate_up, down),
                     weights, active)


def pair_outputs(inputs: torch.Tensor, flat_ids: torch.Tensor, gate_up, down) -> torch.Tensor:
    """experts_per_row's products: pair i's input row inputs[i] through expert flat_ids[i] -> [pairs, H]. A pair's
    values depend on its row and expert alone, for a fixed number of pairs."""
    gate, up = torch.bmm(gate_up[flat_ids], inputs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    return torch.bmm(down[flat_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)


def sum_slots(y: torch.Tensor, weights: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
    """experts_per_row's sum of a row's k pair outputs y [rows * k, H], weighted, in slot order."""
    rows, k = weights.shape
    y = y.view(rows, k, -1) * weights.unsqueeze(-1)
    out = y[:, 0]
    for slot in range(1, k):
        out = out + y[:, slot]
    if active is not None:
        out = out.masked_fill(~active.bool().unsqueeze(-1), 0)
    return out


def experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """Any number of rows (a prompt chunk), expert by expert. Experts are visited in ascending order and their
    outputs summed in x's dtype in that order, so a token's result does not depend on which other tokens share
    the batch."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        g, u = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class SparseMoeBlock(SharedInputProjections):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 normalize: bool):
        super().__init__()
        self.gate = Router(hidden, num_experts, top_k, normalize)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = SwiGLU(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.stack_input_weights()

    def input_weights(self) -> list[nn.Parameter]:
        return [self.gate.weight, self.shared_expert.gate_proj.weight, self.shared_expert.up_proj.weight,
                self.shared_expert_gate.weight]

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        """x [T, H] -> [T, H]. In a decode step idle rows get no routed part (their shared-expert term is still
        computed)."""
        x, ids, weights, shared = self.route(x, step)
        return step.ops.experts(x, ids, weights, self.experts, shared, step)

    def route(self, x: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """What the routed experts take for x [T, H]: (x, expert ids [T, k], their weights [T, k], (the shared
        expert's output, its gate logit)). Everything up to the routed experts, which ops.experts runs."""
        router_logits, swiglu_gate, swiglu_up, shared_gate_logit = self.project_input(x, step)
        ids, weights = self.gate(x, router_logits, step)
        if self.experts.counts is not None and (step.decode or self.experts.count_prompts):
            count_pairs(self.experts.counts, ids, step.flags)
        shared = self.shared_expert(swiglu_gate, swiglu_up, step)
        return x, ids, weights, (shared, shared_gate_logit)


def count_pairs(counts: torch.Tensor, ids: torch.Tensor, flags: torch.Tensor | None) -> None:
    """Add each expert's pairs of `ids` [T, k] to `counts` (a decode step's rows with flags 0 add none), on the
    device, with no host synchronisation."""
    ones = torch.ones_like(ids) if flags is None else flags.to(ids.dtype).unsqueeze(-1).expand_as(ids)
    counts.scatter_add_(0, ids.reshape(-1), ones.reshape(-1))
