"""The torch forms of GGML's quantized blocks (engine/model/quant_blocks.py) against gguf.quants.dequantize, the
reference for every type: bit for bit, on random blocks (every bit pattern of quants, sub-block scales and mins;
finite f16 scales), so a kernel held to the torch form is held to llama.cpp's numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen4exp.checkpoint.gguf_blocks import random_blocks
from qwen4exp.engine.model.quant_blocks import LAYOUTS, dequantize


@pytest.mark.parametrize("qtype", sorted(q for q in LAYOUTS if not q.startswith("FP8_") and q != "Q8_0_256"))
@pytest.mark.parametrize("std, seed", [(0.02, 0), (3.0, 1), (1e-4, 2)])
def test_every_type_dequantizes_bit_for_bit_as_the_reference(qtype, std, seed):
    from gguf import GGMLQuantizationType, quants

    values = LAYOUTS[qtype][0]
    blocks = random_blocks(qtype, (3, 5, 4 * values), std, seed)
    reference = quants.dequantize(blocks, GGMLQuantizationType[qtype])
    ours = dequantize(torch.from_numpy(blocks), qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == reference.shape
    assert np.array_equal(ours.numpy().view(np.uint32), reference.view(np.uint32))


def q8_0_blocks_with_their_own_scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random Q8_0 blocks whose every block has a scale of its own (random_blocks gives a tensor one scale)."""
    blocks = torch.from_numpy(random_blocks("Q8_0", shape, 0.05, seed)).clone()
    view = blocks.view(-1, 34)
    scales = torch.rand(view.shape[0], generator=torch.Generator().manual_seed(seed)) * 0.01 + 1e-4
    view[:, :2] = scales.to(torch.float16).view(torch.uint8).view(-1, 2)
    return blocks


def test_q8_0_regrouped_by_256_holds_the_same_values_with_its_quants_aligned():
    """Q8_0_256 (quant_tiles.LAYOUTS: eight Q8_0 blocks as one, their scales first) gives Q8_0's values bit for bit;
    its quants sit at 16-byte offsets; it converts back to the file's Q8_0 bytes."""
    from qwen4exp.engine.model.quant_blocks import group_q8_0, ungroup_q8_0

    blocks = q8_0_blocks_with_their_own_scales((3, 7, 512), 4)
    grouped = group_q8_0(blocks)
    assert grouped.shape == blocks.shape and torch.equal(ungroup_q8_0(grouped), blocks)
    want = dequantize(blocks, "Q8_0")
    assert torch.equal(dequantize(grouped, "Q8_0_256").view(torch.int32), want.view(torch.int32))
    assert len(set(want[0, 0].view(-1, 32).abs().amax(-1).tolist())) > 8        # the blocks' own scales
    first = grouped.view(-1, 272)[0]
    assert torch.equal(first[16:48].view(torch.int8), blocks.view(-1, 34)[0, 2:].view(torch.int8))
    assert torch.equal(first[2:4], blocks.view(-1, 34)[1, :2])                   # block 1's scale, second


def test_a_model_regroups_its_q8_0_weights_after_the_load_and_answers_the_same():
    """Every Q8_0 stack with rows of whole 256-value groups is regrouped in place (model/regroup.py); the
    torch forms' logits are unchanged bit for bit."""
    from qwen4exp.checkpoint.gguf_loader import quantized_stacks
    from qwen4exp.checkpoint.gguf_writer import PlannedFile
    from qwen4exp.checkpoint.presets import preset_config
    from qwen4exp.checkpoint.random_weights import fill_random, fill_random_stacks
    from qwen4exp.engine.loading import build_model
    from qwen4exp.engine.model.config import ModelConfig
    from qwen4exp.engine.model.quantized import QuantizedStack
    from qwen4exp.engine.model.regroup import regroup_q8_0

    config = preset_config("tiny", dtype="float32")
    config["text_config"].update(hidden_size=256, ple_embed_dim=256, mtp_num_hidden_layers=0)
    cfg = ModelConfig.from_dict(config)
    model = build_model(cfg, torch.float32, torch.device("cpu"), quantized_stacks(PlannedFile(cfg, "q8_0"), cfg))
    fill_random(model, config["text_config"], 0, torch.float32)
    fill_random_stacks(model, 0)
    for module in model.modules():              # every block its own scale
        if isinstance(module, QuantizedStack) and module.qtype == "Q8_0":
            module.blocks.copy_(q8_0_blocks_with_their_own_scales(tuple(module.blocks.shape[:-1]) +
                                                                   (module.shape[-1],), 6).view(module.blocks.shape))
    ids = torch.arange(3, 40)
    before = model(ids, model.new_state(64), all_logits=True)
    stacks = [m for m in model.modules() if isinstance(m, QuantizedStack)]
    eligible = [m for m in stacks if m.qtype == "Q8_0" and m.shape[-1] % 256 == 0]
    assert regroup_q8_0(model) == len(eligible) > 0 and model.lm_head.weight.qtype == "Q8_0_256"
    assert all(m.qtype == "Q8_0" for m in stacks if m not in eligible)
    assert torch.equal(model(ids, model.new_state(64), all_logits=True), before)


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
