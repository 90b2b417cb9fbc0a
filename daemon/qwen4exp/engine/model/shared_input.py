"""Projections that read the same input, computed as one matrix product.

A decode step multiplies a handful of rows by each weight: one small GEMM per projection runs far below memory
bandwidth and costs a launch of its own. A module whose projections share an input therefore keeps their
weights as consecutive row blocks of one [sum of outputs, in] tensor, multiplies once and splits the result.
Each weight's data is a view of its block, so nothing is stored twice, the checkpoint names stay as they are,
and whatever is written into a weight in place (a load's copy_, an optimizer step) is in the stack too.

Weights a GGUF keeps as GGML blocks (quantized.py) stack apart from the dense ones, one stack per block type (a
product reads one kind of weight): a module whose weights are stored alike still makes one product, one that
mixes them (llama.cpp keeps the router and the small Gated DeltaNet gates in F32 beside Q8_0 projections) one per
kind.
"""

from __future__ import annotations

import torch
from torch import nn

from .quantized import QuantizedStack


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts one after the other in one tensor, in pinned host memory when they are (a parked model's weights
    stay pinned, so they go back to the device at the link's full speed)."""
    pinned = parts[0].device.type == "cpu" and parts[0].is_pinned()
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    return torch.cat(parts, out=torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device, pin_memory=pinned))


class SharedInputProjections(nn.Module):
    """Base of a module whose `input_weights()` all multiply the same input. A subclass calls
    `stack_input_weights()` at the end of __init__ and `project_input(x, step)` in its forward. `input_runs` lists
    the stacks, each with the positions (in input_weights' order) of the weights whose row blocks it holds; the
    dense one, if any, is also `input_stack`. Weights are to be written in place: a weight given a new tensor
    (rather than new values) would leave the stack behind."""

    def input_weights(self) -> list[nn.Parameter | QuantizedStack]:
        """The weights [out_i, in] that read the input, in the order `project_input` returns their products."""
        raise NotImplementedError

    def stack_input_weights(self) -> None:
        weights = self.input_weights()
        kinds: dict[str | None, list[int]] = {}
        for i, w in enumerate(weights):
            kinds.setdefault(w.qtype if isinstance(w, QuantizedStack) else None, []).append(i)
        self.input_runs, self.input_stack = [], None
        for qtype, members in kinds.items():
            parts = [weights[i] for i in members]
            if qtype is None:
                with torch.no_grad():
                    stack = self.input_stack = _joined([w.detach() for w in parts])
            else:
                with torch.device("meta"):       # its blocks are the weights' own, joined below
                    stack = QuantizedStack(qtype, (sum(w.shape[0] for w in parts), parts[0].shape[1]),
                                           parts[0].dtype)
                stack.blocks = _joined([w.blocks for w in parts])
            start = 0
            for w in parts:
                end = start + w.shape[0]
                if qtype is None:
                    w.data = stack[start:end]
                else:
                    w.blocks = stack.blocks[start:end]
                start = end
            self.input_runs.append((stack, members))

    def _apply(self, fn, recurse=True):
        # .to(), .to_empty() and the like give each weight memory of its own: stack them again (torch's RNN
        # modules re-flatten their weights at the same point).
        super()._apply(fn, recurse)
        self.stack_input_weights()
        return self

    def project_input(self, x: torch.Tensor, step) -> tuple[torch.Tensor, ...]:
        """(x @ w.T for w in input_weights()), through the step's ops (one product per stack)."""
        weights = self.input_weights()
        if torch.is_grad_enabled() and any(getattr(w, "requires_grad", False) for w in weights):
            # The stack is outside autograd's graph: multiply a copy of it made from the weights, so gradients
            # reach them (same values, same product).
            return step.ops.linear(x, torch.cat(weights), step).split([w.shape[0] for w in weights], dim=-1)
        return step.ops.shared_linear(x, self.input_runs, [w.shape[0] for w in weights], step)
