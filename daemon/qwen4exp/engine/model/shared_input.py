"""Projections that read the same input, computed as one matrix product.

A decode step multiplies a handful of rows by each weight: one small GEMM per projection runs far below memory
bandwidth and costs a launch of its own. A module whose projections share an input therefore keeps their
weights as consecutive row blocks of one [sum of outputs, in] tensor, multiplies once and splits the result.
Each weight's data is a view of its block, so nothing is stored twice, the checkpoint names stay as they are,
and whatever is written into a weight in place (a load's copy_, an optimizer step) is in the stack too.
"""

from __future__ import annotations

import torch
from torch import nn


class SharedInputProjections(nn.Module):
    """Base of a module whose `input_weights()` all multiply the same input. A subclass calls
    `stack_input_weights()` at the end of __init__ and `project_input(x, step)` in its forward; `input_stack` is the
    [sum of outputs, in] tensor whose row blocks the weights are. Weights are to be written in place: a weight
    given a new tensor (rather than new values) would leave the stack behind."""

    def input_weights(self) -> list[nn.Parameter]:
        """The weights [out_i, in] that read the input, in the order `project_input` returns their products."""
        raise NotImplementedError

    def stack_input_weights(self) -> None:
        weights = self.input_weights()
        with torch.no_grad():
            self.input_stack = torch.cat([w.detach() for w in weights])
        start = 0
        for w in weights:
            w.data = self.input_stack[start:start + w.shape[0]]
            start += w.shape[0]

    def _apply(self, fn, recurse=True):
        # .to(), .to_empty() and the like give each weight memory of its own: stack them again (torch's RNN
        # modules re-flatten their weights at the same point).
        super()._apply(fn, recurse)
        self.stack_input_weights()
        return self

    def project_input(self, x: torch.Tensor, step) -> tuple[torch.Tensor, ...]:
        """(x @ w.T for w in input_weights()), from one product through the step's ops."""
        weights = self.input_weights()
        stack = self.input_stack
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            # The stack is outside autograd's graph: multiply a copy of it made from the weights, so gradients
            # reach them (same values, same product).
            stack = torch.cat(weights)
        product = step.ops.linear(x, stack, step)
        return product.split([w.shape[0] for w in weights], dim=-1)
