"""The torch forms of GGML's quantized blocks (engine/model/quant_blocks.py) against gguf.quants.dequantize, the
reference for every type: bit for bit, on random blocks (every bit pattern of quants, sub-block scales and mins;
finite f16 scales), so a kernel held to the torch form is held to llama.cpp's numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen4exp.checkpoint.gguf_blocks import random_blocks
from qwen4exp.engine.model.quant_blocks import LAYOUTS, dequantize


@pytest.mark.parametrize("qtype", sorted(LAYOUTS))
@pytest.mark.parametrize("std, seed", [(0.02, 0), (3.0, 1), (1e-4, 2)])
def test_every_type_dequantizes_bit_for_bit_as_the_reference(qtype, std, seed):
    from gguf import GGMLQuantizationType, quants

    values = LAYOUTS[qtype][0]
    blocks = random_blocks(qtype, (3, 5, 4 * values), std, seed)
    reference = quants.dequantize(blocks, GGMLQuantizationType[qtype])
    ours = dequantize(torch.from_numpy(blocks), qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == reference.shape
    assert np.array_equal(ours.numpy().view(np.uint32), reference.view(np.uint32))


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="Q4_K rows are whole 144-byte blocks"):
        dequantize(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="no torch form for Q2_K"):
        dequantize(torch.zeros(2, 84, dtype=torch.uint8), "Q2_K")


def test_a_quantized_stack_gives_experts_dequantized_in_the_models_dtype():
    from qwen4exp.engine.model.quantized import QuantizedStack

    blocks = torch.from_numpy(random_blocks("Q5_1", (4, 8, 64), 0.02, seed=5))
    stack = QuantizedStack("Q5_1", (4, 8, 64), torch.float32)
    stack.blocks.copy_(blocks)
    dense = dequantize(blocks, "Q5_1")
    assert torch.equal(stack[2], dense[2])
    assert torch.equal(stack[torch.tensor([3, 0, 3])], dense[[3, 0, 3]])     # a decode step gathers by ids
    stack.to(torch.bfloat16)                                                  # a cast of the model
    assert stack.blocks.dtype == torch.uint8 and stack[1].dtype == torch.bfloat16
    assert torch.equal(stack[1], dense[1].to(torch.bfloat16))
    with pytest.raises(ValueError, match="Q4_K rows hold whole blocks of 256 values"):
        QuantizedStack("Q4_K", (2, 4, 64), torch.float32)
