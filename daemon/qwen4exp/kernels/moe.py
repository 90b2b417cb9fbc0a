"""Fused routed experts in Triton (CUDA and ROCm) for bfloat16/float16 models.

Two entry points replace the torch paths of `moe.Experts`:

* `moe_rows` (decode, a few rows): every (row, slot) pair runs its expert as matrix-vector products that
  stream the expert's weights once with wide coalesced loads. Fixed grid and block shapes, no host
  synchronisation, so a decode step can be captured in a CUDA graph; a row's bits depend on that row alone.
* `moe_grouped` (prefill, many tokens): the (token, slot) pairs are sorted by expert on the device, each
  expert's group padded to a whole number of row blocks, and two grouped GEMMs on the tensor cores run
  gate/up (with the SwiGLU in the epilogue) and down (with the routing weight); a last pass adds each
  token's k slot outputs.

Numerics (both): dot products accumulate in float32; gate and up are rounded to x's dtype (as F.linear
would), silu(gate) is computed in float32 and rounded, and its product with up rounded again, so the
intermediate matches torch's bf16 `F.silu(gate) * up` up to accumulation order. The k slot outputs of a
token are added in float32 in slot order 0..k-1 and rounded once. `moe_rows` keeps each slot's output in
float32 up to that sum; `moe_grouped` rounds each weighted slot output to x's dtype first (it stores
T*k rows of them). No atomics are used and block shapes never depend on the data, so the results are
deterministic. moe_rows' block shapes are fixed; moe_grouped's follow a chunk's `GroupedForm` (its row block, and
whether a quantized stack is dequantized whole), a function of the stacks and the chunk's pair count alone, so a
row's (token's) result does not depend on which other rows share a launch of that form (TritonOps.chunks_experts
runs chunks together only where each would take the same form alone).

Either stack may be kept as GGML blocks (a QuantizedStack of a GGUF's experts): its products then run in
moe_blocks.py's kernels, which dequantize the weights in registers (that file says where their numerics differ),
and the slot sum above.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import guard, moe_blocks
from .expert_groups import group_pairs_by_expert
from .guard import interpreted, tl, triton
from .quant_tiles import dequantize_stack

# Fixed configs, never tuned per call: results must not depend on T. Chosen by the arithmetic below and
# checked in sm_90 SASS (16-byte loads, no spills); not yet timed on an H200 (`--bench` does that).
#
# Decode (moe_rows) is weight-bandwidth bound. Each program streams BLOCK_N weight rows of one expert in
# [BLOCK_N, BLOCK_K] tiles, BLOCK_K along the contiguous axis (one 16-byte load per thread per 8 values),
# all of a tile's loads issued before its FMAs. At T=1 (k=10, H=2560, I=640): gate/up runs 10 * 640/8 = 800
# programs, each 5 tiles of 16 KB (gate + up); down runs 10 * 2560/16 = 1600 programs of 5 tiles of 4 KB.
# Gate/up compiles to ~165 registers (3 programs resident per SM, ~48 KB of loads in flight per SM); 4.8 TB/s
# at ~1 us of latency needs ~36 KB per SM of 132.
ROWS_GATE_UP = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4)
ROWS_DOWN = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4)
COMBINE = dict(BLOCK=1024, num_warps=4)

# Prefill (moe_grouped): tensor-core (wgmma) tiles with 4-stage cp.async pipelining. BLOCK_M also pads each
# expert's group of pairs: at T=16384, k=10, E=512 a group averages 320 pairs, so 64 wastes ~10% on padding.
# Gate/up holds two [64, 64] fp32 accumulators (gate and up for the same features, for the SwiGLU epilogue).
GROUPED_BLOCK_M = 64
GROUPED_GATE_UP = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
GROUPED_DOWN = dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
# A short chunk over quantized stacks (fewer than SMALL_BELOW pairs an expert on average) runs row blocks of
# SMALL_BLOCK_M pairs with two pipeline stages: its experts get a row block or two each either way, and the small
# tile dequantizes the same weight tiles with less padding and shared memory (docs/PERFORMANCE.md, on an H100: a
# full-model MoE layer over Q4_K gate/up and Q5_1 down, 5.90 -> 3.33 ms at 128 tokens and 6.52 -> 5.96 ms at 1024,
# slower from 2048: 9.37 against 6.56 ms).
SMALL_BLOCK_M = 16
SMALL_BELOW = 24
SMALL_STAGES = 2


class GroupedForm(NamedTuple):
    """How moe_grouped runs a chunk: its row block, and whether each quantized stack is dequantized whole first
    (moe_blocks.dequantized_for). Each choice may round a row otherwise, so chunks share a launch only in one form."""
    block_m: int
    dequantize_gate_up: bool
    dequantize_down: bool


def grouped_form(gate_up, down, pairs: int) -> GroupedForm:
    """The form of a chunk of `pairs` (token, slot) pairs over these stacks: shapes alone, never the data."""
    whole = moe_blocks.dequantized_for(gate_up, pairs), moe_blocks.dequantized_for(down, pairs)
    tiles_in_registers = any(_is_blocks(stack) and not dense for stack, dense in zip((gate_up, down), whole))
    small = tiles_in_registers and pairs < SMALL_BELOW * gate_up.shape[0]
    return GroupedForm(SMALL_BLOCK_M if small else GROUPED_BLOCK_M, *whole)


def _is_blocks(stack) -> bool:
    """Whether an expert stack is kept as GGML blocks (moe_blocks.py's kernels read it) rather than dense."""
    return not isinstance(stack, torch.Tensor)


def _dense_contiguous(stack):
    return stack if _is_blocks(stack) else stack.contiguous()


def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor) -> tuple[int, int, int, int]:
    """Shapes and dtypes both entry points rely on; returns (T, H, I, k). Shape checks only: no sync."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if x.dtype not in guard.SUPPORTED_DTYPES:
        raise TypeError(f"fused MoE runs bfloat16/float16 only, got {x.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype or weights.dtype != x.dtype:
        raise TypeError("x, the routing weights and the expert weights must share one dtype")
    rows, hidden = x.shape
    experts, two_inter, hidden_w = gate_up.shape
    if hidden_w != hidden or two_inter % 2 or down.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit x {tuple(x.shape)}")
    if ids.shape != weights.shape or ids.shape[0] != rows:
        raise ValueError("ids and weights must both be [T, k]")
    return rows, hidden, two_inter // 2, ids.shape[1]


if triton is not None:
    from .expert_groups import tile_of, tile_pairs
    from .rounding import round_to, rounded, silu_mul

    # top_k is not specialized: engine/hot_experts.py runs pairs as rows of one slot each, which would make 1
    # a binary of its own, built on a request's path.
    @triton.jit(do_not_specialize=["top_k"])
    def _rows_gate_up_kernel(x_ptr, ids_ptr, active_ptr, w_ptr, h_ptr, hidden, inter, top_k,
                             INTERPRETED: tl.constexpr, HAS_ACTIVE: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """h[pair, n] = silu(gate_n . x_row) * (up_n . x_row) for one (row, slot) pair and BLOCK_N features."""
        pair = tl.program_id(0)
        block_n = tl.program_id(1)
        row = pair // top_k
        if HAS_ACTIVE:
            if tl.load(active_ptr + row) == 0:
                return  # an idle row reads no weights; moe_rows zeroes its output
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        feat = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        feat_ok = feat < inter
        cols = tl.arange(0, BLOCK_K)
        gate_ptrs = w_ptr + expert * (2 * inter) * hidden + feat[:, None] * hidden + cols[None, :]
        up_ptrs = gate_ptrs + inter * hidden
        x_ptrs = x_ptr + row.to(tl.int64) * hidden + cols
        acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_K):
            col_ok = cols < hidden - start
            tile_ok = feat_ok[:, None] & col_ok[None, :]
            xv = tl.load(x_ptrs, mask=col_ok, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptrs, mask=tile_ok, other=0.0)
            up = tl.load(up_ptrs, mask=tile_ok, other=0.0)
            acc_gate += gate.to(tl.float32) * xv[None, :]
            acc_up += up.to(tl.float32) * xv[None, :]
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        h = silu_mul(tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1), h_ptr.dtype.element_ty, INTERPRETED)
        tl.store(h_ptr + pair.to(tl.int64) * inter + feat, h, mask=feat_ok)

    @triton.jit(do_not_specialize=["top_k"])   # as the gate/up kernel's
    def _rows_down_kernel(h_ptr, ids_ptr, weights_ptr, active_ptr, w_ptr, y_ptr, hidden, inter, top_k,
                          HAS_ACTIVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[pair, n] = weight[pair] * (down_n . h[pair]) in float32, for BLOCK_N output features."""
        pair = tl.program_id(0)
        block_n = tl.program_id(1)
        row = pair // top_k
        if HAS_ACTIVE:
            if tl.load(active_ptr + row) == 0:
                return
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        feat = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        feat_ok = feat < hidden
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + expert * hidden * inter + feat[:, None] * inter + cols[None, :]
        h_ptrs = h_ptr + pair.to(tl.int64) * inter + cols
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for start in range(0, inter, BLOCK_K):
            col_ok = cols < inter - start
            hv = tl.load(h_ptrs, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=feat_ok[:, None] & col_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * hv[None, :]
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1) * tl.load(weights_ptr + pair).to(tl.float32)
        tl.store(y_ptr + pair.to(tl.int64) * hidden + feat, y, mask=feat_ok)

    @triton.jit
    def _combine_slots_kernel(y_ptr, active_ptr, shared_ptr, gate_ptr, gate_stride, out_ptr, hidden, top_k,
                              INTERPRETED: tl.constexpr, HAS_ACTIVE: tl.constexpr, HAS_SHARED: tl.constexpr,
                              BLOCK: tl.constexpr):
        """out[row] = y[row, 0] + ... + y[row, k-1] in float32, slot order, rounded once; idle rows' sum is 0.
        HAS_SHARED: then + sigmoid(gate[row]) * shared[row] (idle rows too), each op rounded as torch's would be."""
        row = tl.program_id(0)
        feat = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        limit = hidden
        if HAS_ACTIVE:  # an idle row reads nothing (its y was never written) and stores zeros
            limit = (tl.load(active_ptr + row) != 0).to(tl.int32) * hidden
        ok = feat < limit
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        y_ptrs = y_ptr + row.to(tl.int64) * top_k * hidden + feat
        for _slot in range(top_k):
            acc += tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
            y_ptrs += hidden
        dtype = out_ptr.dtype.element_ty
        if HAS_SHARED:
            scale = rounded(tl.sigmoid(tl.load(gate_ptr + row * gate_stride).to(tl.float32)), dtype, INTERPRETED)
            shared = tl.load(shared_ptr + row.to(tl.int64) * hidden + feat, mask=feat < hidden, other=0.0)
            acc = rounded(acc, dtype, INTERPRETED) + rounded(scale * shared.to(tl.float32), dtype, INTERPRETED)
        tl.store(out_ptr + row.to(tl.int64) * hidden + feat, round_to(acc, dtype, INTERPRETED), mask=feat < hidden)

    @triton.jit(do_not_specialize=["num_pairs"])   # a prompt's length changes it: one binary for all
    def _grouped_gate_up_kernel(x_ptr, pair_of_row_ptr, expert_of_block_ptr, w_ptr, h_ptr,
                                num_pairs, num_experts, hidden, inter, top_k, INTERPRETED: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """h[padded row] = silu(x[token] @ gate^T) * (x[token] @ up^T) for one row block and BLOCK_N features."""
        block_m, expert, feat = tile_of(tl.program_id(0), inter, expert_of_block_ptr, BLOCK_N)
        if expert >= num_experts:
            return  # past the last padded group: the grid is sized by an upper bound
        rows, pair, pair_ok = tile_pairs(block_m, pair_of_row_ptr, num_pairs, BLOCK_M)
        token = tl.where(pair_ok, pair // top_k, 0).to(tl.int64)
        feat_ok = feat < inter
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + token[:, None] * hidden + ks[None, :]
        gate_ptrs = w_ptr + expert * (2 * inter) * hidden + feat[None, :] * hidden + ks[:, None]
        up_ptrs = gate_ptrs + inter * hidden
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_K):
            k_ok = ks < hidden - start
            a = tl.load(x_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            gate = tl.load(gate_ptrs, mask=k_ok[:, None] & feat_ok[None, :], other=0.0)
            up = tl.load(up_ptrs, mask=k_ok[:, None] & feat_ok[None, :], other=0.0)
            if INTERPRETED:
                a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
            acc_gate = tl.dot(a, gate, acc_gate)
            acc_up = tl.dot(a, up, acc_up)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        h = silu_mul(acc_gate, acc_up, h_ptr.dtype.element_ty, INTERPRETED)
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * inter + feat[None, :]
        tl.store(h_ptrs, h, mask=feat_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])   # a prompt's length changes it: one binary for all
    def _grouped_down_kernel(h_ptr, pair_of_row_ptr, expert_of_block_ptr, weights_ptr, w_ptr, y_ptr,
                             num_pairs, num_experts, hidden, inter, INTERPRETED: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[pair] = weight[pair] * (h[padded row] @ down^T), rounded to y's dtype, for BLOCK_N features."""
        block_m, expert, feat = tile_of(tl.program_id(0), hidden, expert_of_block_ptr, BLOCK_N)
        if expert >= num_experts:
            return
        rows, pair, pair_ok = tile_pairs(block_m, pair_of_row_ptr, num_pairs, BLOCK_M)
        feat_ok = feat < hidden
        ks = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * inter + ks[None, :]
        w_ptrs = w_ptr + expert * hidden * inter + feat[None, :] * inter + ks[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, inter, BLOCK_K):
            k_ok = ks < inter - start
            a = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & feat_ok[None, :], other=0.0)
            if INTERPRETED:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        route = tl.load(weights_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)
        y = round_to(acc * route[:, None], y_ptr.dtype.element_ty, INTERPRETED)
        safe_pair = tl.where(pair_ok, pair, 0).to(tl.int64)
        tl.store(y_ptr + safe_pair[:, None] * hidden + feat[None, :], y, mask=pair_ok[:, None] & feat_ok[None, :])


def _combine(y: torch.Tensor, flags: torch.Tensor | None, rows: int, hidden: int, top_k: int,
             dtype: torch.dtype, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[rows * k, H] slot outputs -> [rows, H]: the slot sum in float32, in slot order, rounded once; plus
    sigmoid(gate) * term for shared = (term [rows, H], gate [rows, 1])."""
    out = torch.empty(rows, hidden, device=y.device, dtype=dtype)
    term, gate = shared if shared is not None else (out, out)
    if shared is not None and (term.shape != (rows, hidden) or gate.shape != (rows, 1)):
        raise ValueError(f"the shared expert's term must be [{rows}, {hidden}] and its gate [{rows}, 1], got "
                         f"{tuple(term.shape)} and {tuple(gate.shape)}")
    grid = (rows, triton.cdiv(hidden, COMBINE["BLOCK"]))
    _combine_slots_kernel[grid](y, flags if flags is not None else y, term.contiguous(), gate, gate.stride(0), out,
                                hidden, top_k, INTERPRETED=interpreted(y), HAS_ACTIVE=flags is not None,
                                HAS_SHARED=shared is not None, **COMBINE)
    return out


def _flags(active: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    if active is None:
        return None
    if active.shape != (rows,):
        raise ValueError(f"active must be [{rows}], got {tuple(active.shape)}")
    # uint8 as given (the decode step converts once), else a new tensor: torch.compile cannot view bool
    return active if active.dtype == torch.uint8 else (active != 0).to(torch.uint8)


def moe_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, active: torch.Tensor | None = None,
             shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode: x [T, H], ids/weights [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x's dtype.
    Rows with active == False read no expert weights (nor x, ids or weights): their routed part is zero. With
    shared = (term [T, H], gate logit [T, 1]), sigmoid(gate) * term is added (to every row) in the slot sum's
    kernel.
    Three launches (gate/up, down, slot sum) whose grids depend only on the shapes: CUDA-graph safe."""
    rows, hidden, inter, top_k = _check(x, ids, weights, gate_up, down)
    if rows == 0 or top_k == 0:
        return _nothing_routed(x, shared)
    flags = _flags(active, rows)
    return combine_slots(pair_outputs(x, ids, weights, gate_up, down, flags), flags, top_k, x.dtype, shared)


def pair_outputs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
    """moe_rows' first two launches: each (row, slot) pair's weighted expert output [T * k, H] in float32. A pair's
    values depend on its row, expert and weight alone: the same with x's rows repeated k times and one slot each
    (engine/hot_experts.py runs some pairs on another device that way). Rows whose `flags` (uint8 [T]) are 0 are
    not written."""
    rows, hidden, inter, top_k = _check(x, ids, weights, gate_up, down)
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    gate_up, down = _dense_contiguous(gate_up), _dense_contiguous(down)
    pairs = rows * top_k
    h = torch.empty(pairs, inter, device=x.device, dtype=x.dtype)
    y = torch.empty(pairs, hidden, device=x.device, dtype=torch.float32)
    flag_arg = flags if flags is not None else ids  # never read when HAS_ACTIVE is False
    common = dict(INTERPRETED=interpreted(x), HAS_ACTIVE=flags is not None)
    if _is_blocks(gate_up):
        moe_blocks.rows_gate_up(x, ids, flag_arg, gate_up, h, top_k, common)
    else:
        grid = (pairs, triton.cdiv(inter, ROWS_GATE_UP["BLOCK_N"]))
        _rows_gate_up_kernel[grid](x, ids, flag_arg, gate_up, h, hidden, inter, top_k, **common, **ROWS_GATE_UP)
    if _is_blocks(down):
        moe_blocks.rows_down(h, ids, weights, flag_arg, down, y, top_k, common)
    else:
        grid = (pairs, triton.cdiv(hidden, ROWS_DOWN["BLOCK_N"]))
        _rows_down_kernel[grid](h, ids, weights, flag_arg, down, y, hidden, inter, top_k,
                                HAS_ACTIVE=flags is not None, **ROWS_DOWN)
    return y


def combine_slots(y: torch.Tensor, flags: torch.Tensor | None, top_k: int, dtype: torch.dtype,
                  shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """moe_rows' last launch over pair outputs y [T * k, H] (pair_outputs'): [T, H] in `dtype`."""
    return _combine(y, flags, y.shape[0] // top_k, y.shape[1], top_k, dtype, shared)


def grouped_configs(device: torch.device, itemsize: int, m: int = GROUPED_BLOCK_M) -> tuple[dict, dict]:
    """The grouped kernels' configs for row blocks of `m` pairs, with as many of their pipeline stages as fit on
    `device`: a gate/up stage holds an [M, K] tile of x and the gate's and the up projection's [K, N] tiles, a down
    stage one of each."""
    gu, dn = GROUPED_GATE_UP, GROUPED_DOWN
    if m == SMALL_BLOCK_M:
        gu, dn = gu | {"num_stages": SMALL_STAGES}, dn | {"num_stages": SMALL_STAGES}
    gate_up_stage = (m * gu["BLOCK_K"] + 2 * gu["BLOCK_K"] * gu["BLOCK_N"]) * itemsize
    down_stage = (m * dn["BLOCK_K"] + dn["BLOCK_K"] * dn["BLOCK_N"]) * itemsize
    return (gu | {"num_stages": guard.stages_for(device, gate_up_stage, gu["num_stages"])},
            dn | {"num_stages": guard.stages_for(device, down_stage, dn["num_stages"])})


def _nothing_routed(x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """No (token, slot) pair to run: the routed sum is zero, and the shared expert's term is added to it."""
    routed = torch.zeros_like(x)
    return routed if shared is None else routed + torch.sigmoid(shared[1]) * shared[0]


def moe_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, form: GroupedForm | None = None,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Prefill: x [T, H], ids/weights [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x's dtype,
    through grouped GEMMs over the pairs sorted by expert, in `form` (default: the rows' own, grouped_form). No
    host synchronisation; the grids are sized by the padded upper bound and blocks past the last group exit at
    once. With shared = (term [T, H], gate logit [T, 1]), sigmoid(gate) * term is added in the slot sum's kernel,
    as moe_rows adds it (each op rounded as torch's would be)."""
    rows, hidden, inter, top_k = _check(x, ids, weights, gate_up, down)
    if rows == 0 or top_k == 0:
        return _nothing_routed(x, shared)
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    gate_up, down = _dense_contiguous(gate_up), _dense_contiguous(down)
    num_experts = gate_up.shape[0]
    pairs = rows * top_k
    form = form or grouped_form(gate_up, down, pairs)
    if pairs + num_experts * form.block_m >= 2**31:
        raise ValueError("too many (token, slot) pairs for int32 row indices")
    pair_of_row, expert_of_block = group_pairs_by_expert(ids, num_experts, form.block_m)
    max_blocks = expert_of_block.numel()
    on_cpu = interpreted(x)
    gate_up_config, down_config = grouped_configs(x.device, x.element_size(), form.block_m)
    gate_up = dequantize_stack(gate_up) if form.dequantize_gate_up else gate_up
    down = dequantize_stack(down) if form.dequantize_down else down
    common = dict(INTERPRETED=on_cpu, BLOCK_M=form.block_m)
    h = torch.empty(pair_of_row.numel(), inter, device=x.device, dtype=x.dtype)
    if _is_blocks(gate_up):
        moe_blocks.grouped_gate_up(x, pair_of_row, expert_of_block, gate_up, h, pairs, top_k,
                                   moe_blocks.grouped_config("gate/up", gate_up, form.block_m, gate_up_config), common)
    else:
        grid = (max_blocks * triton.cdiv(inter, gate_up_config["BLOCK_N"]),)
        _grouped_gate_up_kernel[grid](x, pair_of_row, expert_of_block, gate_up, h, pairs, num_experts, hidden,
                                      inter, top_k, **common, **gate_up_config)
    y = torch.empty(pairs, hidden, device=x.device, dtype=x.dtype)
    if _is_blocks(down):
        moe_blocks.grouped_down(h, pair_of_row, expert_of_block, weights, down, y, pairs,
                                moe_blocks.grouped_config("down", down, form.block_m, down_config), common)
    else:
        grid = (max_blocks * triton.cdiv(hidden, down_config["BLOCK_N"]),)
        _grouped_down_kernel[grid](h, pair_of_row, expert_of_block, weights, down, y, pairs, num_experts, hidden,
                                   inter, **common, **down_config)
    return _combine(y, None, rows, hidden, top_k, x.dtype, shared)
