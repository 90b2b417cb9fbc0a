"""Expert weights kept as GGML blocks, as a quantized GGUF stores them: 95% of the model's bytes stay quantized.

A `QuantizedStack` stands where `Experts` keeps a dense [E, rows, cols] parameter: `blocks` is uint8
[E, rows, row bytes] of one block type, and indexing it by expert (an int or a tensor of ids, as the torch forms
of the experts index the dense stacks) gives those experts' weights dequantized (quant_blocks.py, bit for bit
llama.cpp's values) in the model's dtype. The torch forms therefore run unchanged on it; the Triton backend runs
the torch form for a quantized stack until its kernels read the blocks themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from . import quant_blocks


class QuantizedStack(nn.Module):
    def __init__(self, qtype: str, shape: tuple[int, int, int], dtype: torch.dtype):
        super().__init__()
        values, size = quant_blocks.LAYOUTS[qtype]
        if shape[-1] % values:
            raise ValueError(f"{qtype} rows hold whole blocks of {values} values; these rows have {shape[-1]}")
        self.qtype, self.shape, self.dtype = qtype, tuple(shape), dtype
        self.register_buffer("blocks", torch.empty(*shape[:-1], shape[-1] // values * size, dtype=torch.uint8))

    def __getitem__(self, index) -> torch.Tensor:
        """The experts `index` selects, dequantized: [rows, cols] for an int, [n, rows, cols] for n ids."""
        return quant_blocks.dequantize(self.blocks[index], self.qtype).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        return self[:]

    def _apply(self, fn, recurse=True):
        # A cast of the model (.to(dtype), .half()) changes the dtype the experts are dequantized to; the blocks
        # stay uint8 and only move.
        super()._apply(fn, recurse)
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=self.blocks.device)).dtype
        return self

    def extra_repr(self) -> str:
        return f"{self.qtype}, shape={self.shape}, dtype={self.dtype}"


def is_quantized(experts: nn.Module) -> bool:
    """Whether an `Experts` module keeps either stack quantized."""
    return isinstance(experts.gate_up_proj, QuantizedStack) or isinstance(experts.down_proj, QuantizedStack)


def keep_quantized(model: nn.Module, stacks: dict[str, tuple[str, tuple[int, int, int]]], dtype: torch.dtype) -> None:
    """Put a QuantizedStack of (type, shape) in place of each named dense stack of `model` (built on meta, before
    its memory is allocated, so the dense stacks never are)."""
    for name, (qtype, shape) in stacks.items():
        owner_name, attr = name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        delattr(owner, attr)
        setattr(owner, attr, QuantizedStack(qtype, shape, dtype))
