"""The sparse MoE block: softmax router with normalised top-k, routed SwiGLU experts, and a shared
expert behind a sigmoid gate. The router, the shared expert's gate/up and its sigmoid gate read the same
input and run as one product (shared_input.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import moe_kernels, router_kernel
from .shared_input import SharedInputProjections


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_projections(self.gate_proj(x), self.up_proj(x))

    def from_projections(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The output given gate_proj(x) and up_proj(x)."""
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None,
                decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] in x's dtype). `logits`: x's product with the weight,
        when the caller has it already (x is still passed, for the training forward's hooks). `decode`: a
        decode step's rows, routed by router_kernel.py's single kernel on GPUs."""
        if logits is None:
            logits = F.linear(x, self.weight)
        if decode and router_kernel.usable(logits):
            return router_kernel.route_rows(logits, self.top_k, self.normalize)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)


class Experts(nn.Module):
    """All experts' weights as two stacked tensors (gate and up fused). bfloat16/float16 models on a GPU
    run the fused Triton kernels of moe_kernels; everything else runs the torch paths below."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def _fused(self, x: torch.Tensor) -> bool:
        """The Triton kernels apply: a GPU tensor in bf16/fp16 and no autograd (they have no backward)."""
        if not (x.is_cuda and x.dtype in moe_kernels.SUPPORTED_DTYPES and moe_kernels.available()
                and self.gate_up_proj.dtype == x.dtype):
            return False
        return not (torch.is_grad_enabled()
                    and (x.requires_grad or self.gate_up_proj.requires_grad or self.down_proj.requires_grad))

    def forward_per_row(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        active: torch.Tensor | None = None,
                        shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Each row through its own k experts, summed in slot order: a row's result depends only on the row
        (for a fixed number of rows), not on other rows' routing. Rows with active False get no routed part
        (zeros). shared = (term, gate logit): + sigmoid(gate) * term for every row (fused into the slot sum on GPUs).
        Fixed shapes and no host synchronisation (a decode step is captured in a CUDA graph)."""
        if self._fused(x):
            return moe_kernels.moe_rows(x, ids, weights, self.gate_up_proj, self.down_proj, active, shared)
        out = self.forward_per_row_torch(x, ids, weights, active)
        return out if shared is None else out + torch.sigmoid(shared[1]) * shared[0]

    def forward_per_row_torch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                              active: torch.Tensor | None = None) -> torch.Tensor:
        """A batch of matrix-vector products over gathered expert weights."""
        rows, k = ids.shape
        flat = ids.reshape(-1)
        inputs = x.repeat_interleave(k, dim=0).unsqueeze(-1)
        gate, up = torch.bmm(self.gate_up_proj[flat], inputs).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = y.view(rows, k, -1) * weights.unsqueeze(-1)
        out = y[:, 0]
        for slot in range(1, k):
            out = out + y[:, slot]
        if active is not None:
            out = out.masked_fill(~active.bool().unsqueeze(-1), 0)
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Any number of rows (prefill). A token's result does not depend on which other tokens share the
        batch, on either path."""
        if self._fused(x):
            return moe_kernels.moe_grouped(x, ids, weights, self.gate_up_proj, self.down_proj)
        return self.forward_torch(x, ids, weights)

    def forward_torch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # Experts are visited in ascending order and their outputs summed in x's dtype in that order,
        # so a token's result does not depend on which other tokens share the batch.
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            token, slot = torch.nonzero(ids == expert, as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
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

    def forward(self, x: torch.Tensor, fixed_rows: bool = False, active: torch.Tensor | None = None) -> torch.Tensor:
        """fixed_rows: a decode step over all slots (each row's result independent of the others'); active
        [T] (bool or uint8) marks the rows in use there, the others' routed output is zero (their shared-expert term
        is still computed)."""
        router_logits, swiglu_gate, swiglu_up, shared_gate_logit = self.project_input(x, decode=fixed_rows)
        ids, weights = self.gate(x, router_logits, decode=fixed_rows)
        shared = self.shared_expert.from_projections(swiglu_gate, swiglu_up)
        if fixed_rows:
            return self.experts.forward_per_row(x, ids, weights, active, (shared, shared_gate_logit))
        return self.experts(x, ids, weights) + torch.sigmoid(shared_gate_logit) * shared
