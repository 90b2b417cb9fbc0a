"""The fused MoE Triton kernels (kernels/moe.py, and moe_blocks.py for expert stacks kept as GGML blocks, which
dequantize in registers: quant_tiles.py), run on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported, and another module of this pytest process may have
imported Triton already (flash-linear-attention does, through kernels/delta_rule.py). So the checks run once, in
one child process started with that variable, and each test below reports one check's verdict.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

E, H, I, K = 8, 64, 32, 2  # experts, hidden, expert intermediate, top-k
REL_TOL = 1e-2


def _setup(dtype_name: str, seed: int = 0):
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype)
    return gate_up, down, gen, dtype


def _routing(rows: int, gen, dtype):
    import torch

    x = torch.randn(rows, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows)])
    weights = torch.rand(rows, K, generator=gen).softmax(-1).to(dtype)
    return x, ids, weights


def _reference(x, ids, weights, gate_up, down):
    """The same math in float64 with no rounding at all."""
    import torch
    import torch.nn.functional as F

    x, weights, gate_up, down = x.double(), weights.double(), gate_up.double(), down.double()
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = ids[row, slot]
            gate, up = (gate_up[expert] @ x[row]).chunk(2)
            out[row] += weights[row, slot] * (down[expert] @ (F.silu(gate) * up))
    return out


def _rel_err(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


def check_rows_match_reference():
    from qwen4exp.kernels.moe import moe_rows

    for dtype_name in ("bfloat16", "float16"):
        gate_up, down, gen, dtype = _setup(dtype_name)
        for rows in (1, 2, 5):
            x, ids, weights = _routing(rows, gen, dtype)
            out = moe_rows(x, ids, weights, gate_up, down)
            assert out.dtype == dtype and out.shape == (rows, H)
            err = _rel_err(out, _reference(x, ids, weights, gate_up, down))
            assert err < REL_TOL, f"{dtype_name} T={rows}: rel err {err:.2e}"


def check_rows_inactive_are_zero_and_rows_independent():
    import torch

    from qwen4exp.kernels.moe import moe_rows

    gate_up, down, gen, dtype = _setup("bfloat16", seed=1)
    x, ids, weights = _routing(4, gen, dtype)
    active = torch.tensor([True, False, True, False])
    x[3] = float("nan")  # an idle row's input is never read
    out = moe_rows(x, ids, weights, gate_up, down, active)
    assert torch.equal(out[1], torch.zeros(H, dtype=dtype)) and torch.equal(out[3], torch.zeros(H, dtype=dtype))
    full = moe_rows(x[:3], ids[:3], weights[:3], gate_up, down)
    want = _reference(x[:3], ids[:3], weights[:3], gate_up, down)
    assert _rel_err(out[[0, 2]], want[[0, 2]]) < REL_TOL
    assert torch.equal(full[0], out[0]) and torch.equal(full[2], out[2])  # `active` changes no active row

    # Row 0 keeps its input and routing; every other row's values, routing and activity change.
    other_x, other_ids, other_weights = _routing(4, gen, dtype)
    other_x[0], other_ids[0], other_weights[0] = x[0], ids[0], weights[0]
    other = moe_rows(other_x, other_ids, other_weights, gate_up, down, torch.tensor([True, True, False, True]))
    assert torch.equal(other[0], out[0])
    again = moe_rows(x, ids, weights, gate_up, down, active)
    assert torch.equal(again, out)  # run to run


def check_rows_shared_term_matches_torch():
    """The shared expert's gated term added in the slot sum's kernel equals torch's routed + sigmoid(g) * s in
    the model dtype bit for bit, idle rows included (their routed part is zero)."""
    import torch

    from qwen4exp.kernels.moe import moe_rows

    gate_up, down, gen, dtype = _setup("bfloat16", seed=5)
    x, ids, weights = _routing(4, gen, dtype)
    active = torch.tensor([True, False, True, True])
    term = torch.randn(4, H, generator=gen).to(dtype)
    wide = torch.randn(4, 3, generator=gen).to(dtype)        # the gate logit as a column view, as in the block
    got = moe_rows(x, ids, weights, gate_up, down, active, shared=(term, wide[:, 1:2]))
    want = moe_rows(x, ids, weights, gate_up, down, active) + torch.sigmoid(wide[:, 1:2]) * term
    assert torch.equal(got, want)
    # Flags are 0 or not: a flag of 2 is an active row, not a longer one.
    flags = torch.tensor([2, 0, 1, 1], dtype=torch.uint8)
    assert torch.equal(moe_rows(x, ids, weights, gate_up, down, flags, shared=(term, wide[:, 1:2])), got)
    # No routed experts: the shared term alone, as the torch path gives.
    none = moe_rows(x, ids[:, :0], weights[:, :0], gate_up, down, active, shared=(term, wide[:, 1:2]))
    assert torch.equal(none, torch.sigmoid(wide[:, 1:2]) * term)


def check_grouped_shared_term_matches_torch():
    """A prompt chunk's shared expert term, added in the grouped path's slot sum, equals torch's
    routed + sigmoid(g) * s bit for bit; with no routed experts it is the term alone."""
    import torch

    from qwen4exp.kernels.moe import moe_grouped

    gate_up, down, gen, dtype = _setup("bfloat16", seed=6)
    x, ids, weights = _routing(37, gen, dtype)
    term = torch.randn(37, H, generator=gen).to(dtype)
    wide = torch.randn(37, 3, generator=gen).to(dtype)
    got = moe_grouped(x, ids, weights, gate_up, down, shared=(term, wide[:, 1:2]))
    assert torch.equal(got, moe_grouped(x, ids, weights, gate_up, down) + torch.sigmoid(wide[:, 1:2]) * term)
    none = moe_grouped(x, ids[:, :0], weights[:, :0], gate_up, down, shared=(term, wide[:, 1:2]))
    assert torch.equal(none, torch.sigmoid(wide[:, 1:2]) * term)


def check_grouped_match_reference():
    import torch

    from qwen4exp.kernels.expert_groups import group_pairs_by_expert
    from qwen4exp.kernels.moe import moe_grouped

    for dtype_name in ("bfloat16", "float16"):
        gate_up, down, gen, dtype = _setup(dtype_name, seed=2)
        for rows in (1, 5, 40):
            x, ids, weights = _routing(rows, gen, dtype)
            if rows == 40:
                ids[:, 0] = 3  # one expert with more pairs than a row block, others with few or none
                ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
            out = moe_grouped(x, ids, weights, gate_up, down)
            assert out.dtype == dtype and out.shape == (rows, H)
            err = _rel_err(out, _reference(x, ids, weights, gate_up, down))
            assert err < REL_TOL, f"{dtype_name} T={rows}: rel err {err:.2e}"

    # Layout: every pair once, grouped by expert in ascending pair order, each group a whole number of blocks.
    ids = torch.tensor([[1, 0], [1, 3], [0, 1]])
    pair_of_row, expert_of_block = group_pairs_by_expert(ids, num_experts=5, block_m=2)
    assert pair_of_row.tolist() == [1, 4, 0, 2, 5, 6, 3, 6] + [6] * 8  # 6 = padding (the pair count)
    assert expert_of_block.tolist() == [0, 1, 1, 3, 5, 5, 5, 5]  # 5 = past the last group


def _layout_cases():
    """Routings whose layouts differ in every way a chunk's can: one pair, experts with no pairs, a group
    longer than a row block, every pair on one expert, the last expert, 4096 tokens of the full model's top 10."""
    import torch

    gen = torch.Generator().manual_seed(11)
    yield torch.tensor([[3]]), 5, 2
    yield torch.tensor([[1, 0], [1, 3], [0, 1]]), 5, 2
    yield torch.full((40, 2), 4), 5, 16
    yield torch.randint(0, 8, (37, 3), generator=gen), 8, 16
    yield torch.randint(0, 512, (4096, 10), generator=gen), 512, 16
    yield torch.randint(0, 512, (700, 10), generator=gen) // 7 * 7, 512, 64   # every seventh expert only


def check_the_layout_kernels_give_the_torch_layout():
    import torch

    from qwen4exp.kernels.expert_groups import group_pairs_by_expert, group_pairs_in_torch

    for ids, experts, block_m in _layout_cases():
        got, want = group_pairs_by_expert(ids, experts, block_m), group_pairs_in_torch(ids, experts, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (tuple(ids.shape), experts, block_m)


def check_grouped_is_batch_invariant():
    import torch

    from qwen4exp.kernels.moe import moe_grouped

    gate_up, down, gen, dtype = _setup("bfloat16", seed=3)
    x, ids, weights = _routing(40, gen, dtype)
    whole = moe_grouped(x, ids, weights, gate_up, down)
    assert torch.equal(moe_grouped(x[:7], ids[:7], weights[:7], gate_up, down), whole[:7])
    assert torch.equal(moe_grouped(x, ids, weights, gate_up, down), whole)


def check_cpu_models_take_the_torch_forms():
    """A bfloat16 model on the CPU runs the torch forms (the kernels are for GPUs); the per-row form gives idle
    rows zeros and the others what they get with every row active."""
    import torch

    from qwen4exp.engine.model import moe
    from qwen4exp.engine.model.backend import ops_for
    from qwen4exp.engine.model.ops import TORCH_OPS

    gate_up, down, gen, dtype = _setup("bfloat16", seed=4)
    assert ops_for(gate_up) is TORCH_OPS
    x, ids, weights = _routing(3, gen, torch.float32)
    active = torch.tensor([True, False, True])
    out = moe.experts_per_row(x, ids, weights, gate_up.float(), down.float(), active)
    assert torch.equal(out[1], torch.zeros(H))
    assert torch.equal(out[[0, 2]], moe.experts_per_row(x, ids, weights, gate_up.float(), down.float())[[0, 2]])


# Expert stacks kept as blocks (kernels/moe_blocks.py): each pair (gate/up type, down type) as a GGUF may mix
# them, together reaching every block type, and each 32-value one as a down type; K-quant and IQ4_XS rows hold whole
# 256-value blocks. The FP8 types are an FP8 checkpoint's (checkpoint/fp8.py): 128-value runs where the widths allow,
# 32 where not; rows of two FP8_B128 blocks take the grouped GEMMs' word tile (quant_tiles.fp8_b128_words_tile) across
# a block's end.
WHOLE_256 = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "FP8_B128")    # down types whose rows hold 256 values
BLOCK_PAIRS = [("Q4_K", "Q5_1"), ("Q5_K", "Q8_0"), ("Q6_K", "Q4_0"), ("IQ4_XS", "IQ4_NL"), ("Q4_1", "Q5_0"),
               ("Q5_0", "Q4_1"), ("Q8_0", "Q6_K"), ("FP8_B128", "FP8_B32"), ("FP8_B32", "FP8_B128")]
QH, QI = 256, 64


def _stack(qtype: str, shape: tuple[int, ...], seed: int):
    import torch

    from qwen4exp.checkpoint.gguf_blocks import random_blocks
    from qwen4exp.engine.model.quantized import QuantizedStack

    stack = QuantizedStack(qtype, shape, torch.bfloat16)
    stack.blocks.copy_(torch.from_numpy(random_blocks(qtype, shape, 0.05, seed)))
    return stack


def check_in_register_dequantization_is_the_torch_forms_bit_for_bit():
    """quant_tiles.dequantize_groups, as every block kernel reads weights, against quant_blocks (itself held to
    gguf.quants): random blocks reach every quant, sub-block scale and min pattern."""
    import torch

    from qwen4exp.checkpoint.gguf_blocks import random_blocks
    from qwen4exp.engine.model.quant_blocks import LAYOUTS, dequantize
    from qwen4exp.kernels.quant_tiles import QTYPES, dequantize_rows, gather_rows

    for qtype in QTYPES:
        for std, seed in ((0.02, 0), (3.0, 1)):
            blocks = torch.from_numpy(random_blocks(qtype, (3, 2, 2 * max(256, LAYOUTS[qtype][0])), std, seed))
            want = dequantize(blocks, qtype)
            assert torch.equal(dequantize_rows(blocks, qtype).view(torch.int32), want.view(torch.int32)), qtype
        table = blocks.reshape(6, -1)
        ids = torch.tensor([[5, 0], [5, 2]])
        assert torch.equal(gather_rows(table, qtype, ids, torch.bfloat16), want.reshape(6, -1)[ids].bfloat16())
    for qtype in ("FP8_B32", "FP8_B128"):
        blocks = every_finite_e4m3_byte(qtype)
        assert torch.equal(dequantize_rows(blocks, qtype).view(torch.int32),
                           dequantize(blocks, qtype).view(torch.int32)), qtype


def every_finite_e4m3_byte(qtype: str):
    """FP8 blocks (a row of 256 values) holding each of float8 e4m3's 254 finite bytes, subnormals and both zeros
    among them, under scales from 2^-20 to 3: random float8 values of a checkpoint's spread miss some of them."""
    import torch

    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0, 0x80], dtype=torch.uint8)
    run = 32 if qtype == "FP8_B32" else 128
    values = finite.view(-1, run)
    scales = torch.tensor([2.0 ** -20, 3.0, 0.0071, 1.0 / 3] * 2)[: values.shape[0]]
    return torch.cat([scales.view(torch.uint8).view(-1, 4), values], dim=1).reshape(1, -1)


def decode_kernels_read_each_weight_exactly(device: str) -> None:
    """The decode down kernel in each of its forms (quant_tiles.row_form: a 32-value block as two runs of 16
    values, or a byte a value, which the gate/up kernel runs), over rows of two steps, the second cut short: with
    each pair's h one column's indicator and its route weight 1, a pair's output is that column of its expert's
    weight, which must be the torch form's value (every other product is an exact zero)."""
    import torch
    from torch.nn.functional import one_hot

    from qwen4exp.engine.model.quant_blocks import dequantize
    from qwen4exp.kernels import moe_blocks
    from qwen4exp.kernels.guard import interpreted
    from qwen4exp.kernels.quant_tiles import HALVES

    rows = 16
    for qtype in HALVES + ("Q4_K", "Q6_K", "FP8_B128", "FP8_B32"):
        # 160: 5 blocks, the halves form's 4-block steps, the second cut short; 512: 4 of the byte form's steps
        length = 160 if qtype in HALVES else 512
        down = _stack(qtype, (3, rows, length), 5).to(device)
        columns = torch.arange(0, length, 7)          # in every block and sub-block
        ids = (columns % 3).reshape(-1, 1)            # one pair a row (top-1), its column on one of 3 experts
        h = one_hot(columns, length).bfloat16().to(device)
        y = torch.empty(len(columns), rows, device=device)
        moe_blocks.rows_down(h, ids.to(device), torch.ones(len(columns), 1).bfloat16().to(device), ids.to(device),
                             down, y, 1, dict(INTERPRETED=interpreted(h), HAS_ACTIVE=False))
        want = dequantize(down.blocks.cpu(), qtype)[ids[:, 0], :, columns]    # expert ids[c]'s column c
        # equal as numbers: a zero weight's sign is lost in the sum (+0 + -0 = +0), which changes no product
        assert torch.equal(y.cpu(), want), qtype


def check_the_decode_kernels_read_each_weight_as_the_torch_form_gives_it():
    decode_kernels_read_each_weight_exactly("cpu")


def grouped_down_reads_each_weight_exactly(device: str) -> None:
    """The prompt's grouped down GEMM over every expert block type, in the form it reads that type's tiles in
    (halves, a lane a value, FP8_B128's words), in both row blocks at the engine's configs: with each pair's h one column's indicator
    and its route weight 1, a pair's output is that column of its expert's weight, the torch form's value rounded
    to bfloat16 as a tile rounds it (every other product is an exact zero, so no summation order shows)."""
    import torch
    from torch.nn.functional import one_hot

    from qwen4exp.engine.model.quant_blocks import dequantize
    from qwen4exp.kernels import moe, moe_blocks
    from qwen4exp.kernels.expert_groups import group_pairs_by_expert
    from qwen4exp.kernels.guard import interpreted
    from qwen4exp.kernels.quant_tiles import QTYPES

    features, length = 32, 256                    # 256: whole blocks of every type, four of a tile's 64-value steps
    columns = torch.arange(3, length, 11)          # in every block and sub-block
    ids = (columns % 3).reshape(-1, 1)             # one pair a row (top-1), its column on one of 3 experts
    for qtype in (q for q in QTYPES if q != "Q8_0_R"):
        down = _stack(qtype, (3, features, length), 6).to(device)
        want = dequantize(down.blocks.cpu(), qtype)[ids[:, 0], :, columns].bfloat16()
        for block_m in (moe.SMALL_BLOCK_M, moe.GROUPED_BLOCK_M):
            pair_of_row, expert_of_block = group_pairs_by_expert(ids.to(device), 3, block_m)
            pair = pair_of_row.long().clamp(max=len(columns) - 1)     # a padding row's h is never stored
            h = one_hot(columns.to(device)[pair], length).bfloat16()
            y = torch.full((len(columns), features), float("nan"), dtype=torch.bfloat16, device=device)
            config = moe_blocks.grouped_config("down", down, block_m,
                                               moe.grouped_configs(h.device, h.element_size(), block_m)[1])
            moe_blocks.grouped_down(h, pair_of_row, expert_of_block, torch.ones(len(columns), 1).bfloat16().to(device),
                                    down, y, len(columns), config, dict(INTERPRETED=interpreted(h), BLOCK_M=block_m))
            assert torch.equal(y.cpu(), want), (qtype, block_m)


def check_the_grouped_down_gemm_reads_each_weight_as_the_torch_form_gives_it():
    grouped_down_reads_each_weight_exactly("cpu")


def check_block_stacks_give_their_dense_twins_results():
    """moe_grouped over quantized stacks (tiles dequantized in the GEMMs, or the stacks dequantized whole for a
    long chunk) gives what the dense kernel gives on the stacks' dense twins (the dequantized experts in
    bfloat16), bit for bit: the same values summed (the interpreter sums a tile alike in both layouts). moe_rows
    multiplies by the float32 values, so it is held to the float64 reference, as both are."""
    import torch

    from qwen4exp.engine.model.quant_blocks import dequantize
    from qwen4exp.kernels.moe import moe_grouped, moe_rows

    gen = torch.Generator().manual_seed(7)
    for gate_up_type, down_type in BLOCK_PAIRS:
        inter = 256 if down_type in WHOLE_256 else QI
        gate_up, down = _stack(gate_up_type, (E, 2 * inter, QH), 1), _stack(down_type, (E, QH, inter), 2)
        twin_gate_up, twin_down = gate_up.dequantize(), down.dequantize()
        # 5 tokens: small row blocks; 120 tokens: 30 pairs an expert, the tiles dequantized in the GEMMs over
        # several full row blocks; 260 tokens: 65, past moe_blocks.DENSE_FROM (the stacks dequantized whole): the
        # first pair of types only
        for rows in (5, 120, 260) if gate_up_type == BLOCK_PAIRS[0][0] else (5,):
            x = torch.randn(rows, QH, generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows)])
            weights = torch.rand(rows, K, generator=gen).softmax(-1).bfloat16()
            want = _reference(x, ids, weights, gate_up.dequantize().float(), down.dequantize().float())
            got = moe_grouped(x, ids, weights, gate_up, down)
            assert torch.equal(got, moe_grouped(x, ids, weights, twin_gate_up, twin_down)), (rows, gate_up_type)
            assert _rel_err(got, want) < REL_TOL, ("grouped", gate_up_type, down_type)
            if rows <= 16:
                exact = _reference(x, ids, weights, dequantize(gate_up.blocks, gate_up_type),
                                   dequantize(down.blocks, down_type))
                assert _rel_err(moe_rows(x, ids, weights, gate_up, down), exact) < REL_TOL, (gate_up_type, down_type)


def check_a_chunks_form_follows_its_own_pairs():
    """A chunk over quantized stacks runs small row blocks below moe.SMALL_BELOW pairs an expert, full ones from
    there, its stacks dequantized whole from DENSE_FROM; dense stacks always run full row blocks. Chunks sharing a
    launch in the form each takes alone (TritonOps.chunks_experts) come out as they do alone, whatever their sum's
    form would be."""
    import torch

    from qwen4exp.kernels import moe

    gen = torch.Generator().manual_seed(10)
    gate_up, down = _stack("Q4_K", (E, 2 * QI, QH), 5), _stack("Q8_0", (E, QH, QI), 6)
    small = moe.GroupedForm(moe.SMALL_BLOCK_M, False, False)
    assert moe.grouped_form(gate_up, down, moe.SMALL_BELOW * E - 1) == small
    assert moe.grouped_form(gate_up, down, moe.SMALL_BELOW * E) == (moe.GROUPED_BLOCK_M, False, False)
    assert moe.grouped_form(gate_up, down, 64 * E) == (moe.GROUPED_BLOCK_M, True, True)
    assert moe.grouped_form(gate_up, down.dequantize(), 8).block_m == moe.SMALL_BLOCK_M
    assert moe.grouped_form(gate_up.dequantize(), down.dequantize(), 8).block_m == moe.GROUPED_BLOCK_M
    # chunks of 20, 50 and 70 rows: 5, 12.5 and 17.5 pairs an expert alone; the first two together 17.5; 200 and
    # 100 rows (50 and 25) run full row blocks
    x = torch.randn(200, QH, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(200)])
    weights = torch.rand(200, K, generator=gen).softmax(-1).bfloat16()
    row_blocks, real = [], moe.group_pairs_by_expert      # the row block each launch lays its pairs out in
    moe.group_pairs_by_expert = lambda ids, experts, block_m: row_blocks.append(block_m) or real(ids, experts, block_m)
    try:
        together = moe.moe_grouped(x[:70], ids[:70], weights[:70], gate_up, down, form=small)
        assert torch.equal(together[:20], moe.moe_grouped(x[:20], ids[:20], weights[:20], gate_up, down))
        assert torch.equal(together[20:], moe.moe_grouped(x[20:70], ids[20:70], weights[20:70], gate_up, down))
        full = moe.moe_grouped(x, ids, weights, gate_up, down)
        assert torch.equal(full[100:], moe.moe_grouped(x[100:], ids[100:], weights[100:], gate_up, down))
    finally:
        moe.group_pairs_by_expert = real
    assert row_blocks == [moe.SMALL_BLOCK_M] * 3 + [moe.GROUPED_BLOCK_M] * 2


def check_block_stacks_keep_rows_independent():
    """A decode row's result over quantized stacks depends on that row alone; idle rows read nothing."""
    import torch

    from qwen4exp.kernels.moe import moe_grouped, moe_rows

    gen = torch.Generator().manual_seed(8)
    gate_up, down = _stack("Q4_K", (E, 2 * QI, QH), 3), _stack("Q5_1", (E, QH, QI), 4)
    x = torch.randn(4, QH, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(4)])
    weights = torch.rand(4, K, generator=gen).softmax(-1).bfloat16()
    x[3] = float("nan")
    out = moe_rows(x, ids, weights, gate_up, down, torch.tensor([True, True, False, False]))
    assert torch.equal(out[2:], torch.zeros(2, QH, dtype=torch.bfloat16))
    assert torch.equal(moe_rows(x[:1], ids[:1], weights[:1], gate_up, down)[0], out[0])
    assert torch.equal(moe_grouped(x[:3], ids[:3], weights[:3], gate_up, down)[1],
                       moe_grouped(x[1:2], ids[1:2], weights[1:2], gate_up, down)[0])


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    """Runs every check in one child process with TRITON_INTERPRET=1; {check name: "ok" or its traceback}."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    daemon = str(Path(__file__).resolve().parents[1] / "daemon")
    env["PYTHONPATH"] = os.pathsep.join([daemon, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"checker failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_check(verdicts, name):
    assert verdicts.get(name) == "ok", verdicts.get(name, "not run")


def _run_checks() -> None:
    """Child process: TRITON_INTERPRET=1 is already in the environment, before anything imports Triton."""
    import torch

    torch.set_num_threads(1)
    results = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (the checks need Triton's interpreter)"
    _run_checks()


@pytest.mark.gpu
def test_block_kernels_on_the_gpu():
    """Compiled, on a GPU: the in-register dequantization is the torch form's bit for bit for every type, in the
    decode down kernel's two forms too (decode_kernels_read_each_weight_exactly), and the block kernels give their
    dense twins' results (decode multiplies by float32 weights, not the twin's bfloat16, and compiled tilings sum
    in another order: up to rounding) with each row independent of the others."""
    import torch

    from qwen4exp.checkpoint.gguf_blocks import random_blocks
    from qwen4exp.engine.model.quant_blocks import dequantize
    from qwen4exp.kernels.moe import grouped_form, moe_grouped, moe_rows
    from qwen4exp.kernels.quant_tiles import QTYPES, dequantize_rows

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    decode_kernels_read_each_weight_exactly("cuda")
    grouped_down_reads_each_weight_exactly("cuda")
    from qwen4exp.kernels.expert_groups import group_pairs_by_expert, group_pairs_in_torch
    for ids, experts, block_m in _layout_cases():
        got = group_pairs_by_expert(ids.cuda(), experts, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, group_pairs_in_torch(ids.cuda(), experts, block_m)))
    for qtype in QTYPES:
        blocks = torch.from_numpy(random_blocks(qtype, (64, 2560), 0.5, 3)).cuda()
        assert torch.equal(dequantize_rows(blocks, qtype).view(torch.int32),
                           dequantize(blocks, qtype).view(torch.int32)), qtype
    for qtype in ("FP8_B32", "FP8_B128"):
        blocks = every_finite_e4m3_byte(qtype).cuda()
        assert torch.equal(dequantize_rows(blocks, qtype).view(torch.int32),
                           dequantize(blocks, qtype).view(torch.int32)), qtype
    gen = torch.Generator().manual_seed(9)
    for gate_up_type, down_type in BLOCK_PAIRS:
        inter = 256 if down_type in WHOLE_256 else QI
        gate_up = _stack(gate_up_type, (E, 2 * inter, QH), 1).cuda()
        down = _stack(down_type, (E, QH, inter), 2).cuda()
        for rows, kernel, tolerance in ((4, moe_rows, REL_TOL), (40, moe_grouped, 2e-3), (120, moe_grouped, 2e-3)):
            x = torch.randn(rows, QH, generator=gen).bfloat16().cuda()
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows)]).cuda()
            weights = torch.rand(rows, K, generator=gen).softmax(-1).bfloat16().cuda()
            got = kernel(x, ids, weights, gate_up, down)
            twin = kernel(x, ids, weights, gate_up.dequantize(), down.dequantize())
            assert _rel_err(got.cpu(), twin.cpu().double()) < tolerance, (kernel.__name__, gate_up_type, down_type)
            # in the form of the rows it came with (40 rows, 10 pairs an expert: small row blocks; 120, 30: full)
            form = {} if kernel is moe_rows else {"form": grouped_form(gate_up, down, rows * K)}
            alone = kernel(x[1:2], ids[1:2], weights[1:2], gate_up, down, **form)
            assert torch.equal(alone[0], got[1]), (kernel.__name__, gate_up_type)
