"""The torch forms of GGML's quantized blocks (engine/model/quant_blocks.py) against gguf.quants.dequantize, the
reference for every type: bit for bit, on random blocks (every bit pattern of quants, sub-block scales and mins;
finite f16 scales), so a kernel held to the torch form is held to llama.cpp's numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen4exp.checkpoint.gguf_blocks import random_blocks
from qwen4exp.engine.model.quant_blocks import LAYOUTS, dequantize


@pytest.mark.parametrize("qtype", sorted(q for q in LAYOUTS if not q.startswith("FP8_") and q != "Q8_0_R"))
@pytest.mark.parametrize("std, seed", [(0.02, 0), (3.0, 1), (1e-4, 2)])
def test_every_type_dequantizes_bit_for_bit_as_the_reference(qtype, std, seed):
    from gguf import GGMLQuantizationType, quants

    values = LAYOUTS[qtype][0]
    blocks = random_blocks(qtype, (3, 5, 4 * values), std, seed)
    reference = quants.dequantize(blocks, GGMLQuantizationType[qtype])
    ours = dequantize(torch.from_numpy(blocks), qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == reference.shape
    assert np.array_equal(ours.numpy().view(np.uint32), reference.view(np.uint32))


def test_a_regrouped_q8_0_row_holds_the_same_bytes_and_values():
    """Q8_0_R (each row's scales, then its quants: quantized.regroup_q8_0) is a permutation of a Q8_0 row's bytes,
    undone by join_q8_0, and dequantizes to Q8_0's values bit for bit."""
    from qwen4exp.engine.model.quant_blocks import join_q8_0, split_q8_0

    rows = torch.from_numpy(random_blocks("Q8_0", (3, 4, 512), 0.02, seed=7))
    split = split_q8_0(rows)
    assert split.shape == rows.shape and torch.equal(split.sort(-1).values, rows.sort(-1).values)
    assert torch.equal(split[..., :32].contiguous().view(torch.float16), rows.view(3, 4, 16, 34)[..., :2]
                       .contiguous().view(torch.float16).reshape(3, 4, 16))
    assert torch.equal(join_q8_0(split), rows)
    assert torch.equal(dequantize(split, "Q8_0_R"), dequantize(rows, "Q8_0"))


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


@pytest.mark.parametrize("qtype", ["FP8_B32", "FP8_B128"])
def test_our_fp8_blocks_hold_a_checkpoints_float8_weight_and_its_block_scales(qtype):
    """An FP8 checkpoint's weight repacked as our blocks (checkpoint/fp8.to_blocks) dequantizes to the checkpoint's
    values (fp8.dequantize: float8 x its block's scale), bit for bit, every float8 bit pattern included."""
    from qwen4exp.checkpoint import fp8

    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(0, 256, (300, 512), generator=generator, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=generator) * 0.01
    got = dequantize(fp8.to_blocks(weight, scale, (128, 256), qtype), qtype)
    want = fp8.dequantize(weight, scale, (128, 256))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))        # the NaN patterns too
    assert fp8.kept_type([512, 256], (128, 128)) == "FP8_B128" and fp8.kept_type([64], (128, 128)) == "FP8_B32"
    assert fp8.kept_type([64], (24, 40)) is None and fp8.kept_type([160], None) == "FP8_B32"
