"""Ways to run a decode step's routed experts over GGML blocks, timed side by side on a GPU (an experiment: which
form kernels/moe_blocks.py's row kernels should take).

    python bench/moe_rows_variants.py --out variants.json [--busy 1,4]      # a GPU
    python bench/moe_rows_variants.py --sweep --out variants.json            # and other tilings
    TRITON_INTERPRET=1 python bench/moe_rows_variants.py --check            # each variant against the shipped one

The engine's down kernel (moe_blocks.rows_down) reads a row of a 32-value type (Q5_1, Q8_0) a few blocks a step,
each as two runs of 16 values (quant_tiles.row_form's `halves`: a Q5_1 block's 16 quant bytes and its fifth bits, a
Q8_0 block's quants as 16 two-byte words, since a 34-byte block is only 2-byte aligned); `groups` is the
byte-a-value form (quant_tiles.dequantize_groups, whose addresses Triton cannot prove aligned) that all types had
before and gate/up still runs, gate and up each in a pass of its own. The other variants: the halves form for
gate/up over Q8_0, and `q4k combined`, a kernel of this bench's own that reads Q4_K gate/up a 256-value block a
step (its 128 quant bytes as [4, 32] 16-byte vectors, each byte a value of sub-block 2c and one of 2c + 1, the
scale fields as 32-bit words), gate and up in one loop. `--sweep` times each at other tilings: N rows a program, G
blocks a step, W warps.

Every variant multiplies by the values the shipped kernel multiplies by (the same float32 products of scale, quant
and min) and sums in float32; only the order of the sums differs, so `max_rel` (the largest difference over the
output's largest magnitude) is a rounding difference, not zero. The timings are the decode step's layout: 4 slots'
rows, of which `busy` are active (an idle row's programs return at once, as in the engine), top-10 of 512 experts
at the full model's shapes, each call on other experts (CUDA-graph replay, bench/graph_timing.py).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe_blocks
from qwen4exp.kernels.guard import interpreted
from qwen4exp.kernels.quant_tiles import grid_for, row_form
from qwen4exp.kernels.rounding import silu_mul

EXPERTS, HIDDEN, INTER, TOP_K, SLOTS = 512, 2560, 640, 10, 4
# (product, type): UD-Q4_K_XL's gate/up and its two down types, and Q8_0 gate/up (the q8_0 mix)
CASES = [("gate/up", "Q4_K"), ("down", "Q5_1"), ("down", "Q8_0"), ("gate/up", "Q8_0")]


@triton.jit
def _half(bits):
    """float32 of the float16 in the low 16 bits of uint32 `bits`."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(low, mid, high, j):
    """Q4_K sub-block j's 6-bit (scale, min) from the three little-endian words of its 12 scale bytes."""
    i = ((j & 3) * 8).to(tl.uint32)
    lo = (low >> i) & 255
    mi = (mid >> i) & 255
    hi = (high >> i) & 255
    first = j < 4
    scale = tl.where(first, lo & 63, (hi & 15) | ((lo >> 6) << 4))
    minimum = tl.where(first, mi & 63, (hi >> 4) | ((mi >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _q4k_superblock(rows, at, c, lane, ok):
    """The float32 values of one Q4_K superblock (starting `at` bytes into each of `rows` [N] byte pointers): the
    low-nibble half [N, 4, 32] (sub-blocks 0, 2, 4, 6) and the high one (1, 3, 5, 7), as quant_tiles computes each."""
    head = (rows + at).to(tl.pointer_type(tl.uint32))
    dm = tl.load(head, mask=ok, other=0)
    low = tl.load(head + 1, mask=ok, other=0)[:, None]
    mid = tl.load(head + 2, mask=ok, other=0)[:, None]
    high = tl.load(head + 3, mask=ok, other=0)[:, None]
    d = _half(dm)[:, None, None]
    dmin = _half(dm >> 16)[:, None, None]
    j = tl.arange(0, 4)[None, :] * 2
    scale_lo, min_lo = _k_scale_min(low, mid, high, j)
    scale_hi, min_hi = _k_scale_min(low, mid, high, j + 1)
    quants = tl.load(rows[:, None, None] + at + 16 + c * 32 + lane, mask=ok[:, None, None], other=0).to(tl.int32)
    w_lo = (d * scale_lo[:, :, None]) * (quants & 15).to(tl.float32) - dmin * min_lo[:, :, None]
    w_hi = (d * scale_hi[:, :, None]) * (quants >> 4).to(tl.float32) - dmin * min_hi[:, :, None]
    return w_lo, w_hi


@triton.jit(do_not_specialize=["top_k"])
def _q4k_gate_up_kernel(x_ptr, ids_ptr, active_ptr, w_ptr, h_ptr, hidden, inter, top_k, row_bytes,
                        INTERPRETED: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """h[pair, n] = silu(gate_n . x_row) * (up_n . x_row): a Q4_K superblock of BLOCK_N gate rows and of their up
    rows a step, both in one loop."""
    pair = tl.program_id(0)
    row = pair // top_k
    if HAS_ACTIVE:
        if tl.load(active_ptr + row) == 0:
            return
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    dtype = h_ptr.dtype.element_ty
    feat = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = feat < inter
    gate_rows = w_ptr + (expert * 2 * inter + feat) * row_bytes
    up_rows = gate_rows + inter * row_bytes
    c = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    x_row = x_ptr + row.to(tl.int64) * hidden
    acc_gate = tl.zeros([BLOCK_N, 4, 32], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 4, 32], dtype=tl.float32)
    for block in range(0, hidden // 256):
        x_lo = tl.load(x_row + block * 256 + c * 64 + lane).to(tl.float32)
        x_hi = tl.load(x_row + block * 256 + c * 64 + 32 + lane).to(tl.float32)
        g_lo, g_hi = _q4k_superblock(gate_rows, block * 144, c, lane, ok)
        u_lo, u_hi = _q4k_superblock(up_rows, block * 144, c, lane, ok)
        acc_gate += g_lo * x_lo
        acc_gate += g_hi * x_hi
        acc_up += u_lo * x_lo
        acc_up += u_hi * x_hi
    h = silu_mul(tl.sum(tl.sum(acc_gate, axis=2), axis=1), tl.sum(tl.sum(acc_up, axis=2), axis=1), dtype,
                 INTERPRETED)
    tl.store(h_ptr + pair.to(tl.int64) * inter + feat, h, mask=ok)


def q4k_gate_up(x, ids, flags, stack, h, top_k, config):
    pairs, inter = h.shape
    _q4k_gate_up_kernel[(pairs, triton.cdiv(inter, config["BLOCK_N"]))](
        x, ids, flags, stack.blocks, h, x.shape[1], inter, top_k, stack.blocks.shape[-1], INTERPRETED=interpreted(x),
        HAS_ACTIVE=True, **config)


def engine_gate_up(x, ids, flags, stack, h, top_k, config):
    """moe_blocks' decode gate/up kernel at `config` (FORM, BLOCK_N, GROUPS, num_warps)."""
    pairs, inter = h.shape
    blocks = stack.blocks
    moe_blocks._rows_gate_up_blocks_kernel[(pairs, triton.cdiv(inter, config["BLOCK_N"]))](
        x, ids, flags, blocks, grid_for(stack.qtype, blocks), h, x.shape[1], inter, top_k, blocks.shape[-1],
        QTYPE=stack.qtype, INTERPRETED=interpreted(x), HAS_ACTIVE=True, **config)


def engine_down(h, ids, weights, flags, stack, y, top_k, config):
    """moe_blocks' decode down kernel at `config` (FORM, BLOCK_N, GROUPS, num_warps)."""
    pairs, hidden = y.shape
    blocks = stack.blocks
    moe_blocks._rows_down_blocks_kernel[(pairs, triton.cdiv(hidden, config["BLOCK_N"]))](
        h, ids, weights, flags, blocks, grid_for(stack.qtype, blocks), y, hidden, h.shape[1], top_k, blocks.shape[-1],
        QTYPE=stack.qtype, INTERPRETED=interpreted(h), HAS_ACTIVE=True, **config)


def shipped_gate_up(x, ids, flags, stack, h, top_k, config):
    moe_blocks.rows_gate_up(x, ids, flags, stack, h, top_k, dict(INTERPRETED=interpreted(x), HAS_ACTIVE=True))


def shipped_down(h, ids, weights, flags, stack, y, top_k, config):
    moe_blocks.rows_down(h, ids, weights, flags, stack, y, top_k, dict(INTERPRETED=interpreted(h), HAS_ACTIVE=True))


def variants(kind: str, qtype: str, sweep: bool = True) -> dict:
    """name -> (launch, config): the engine's own launch first, then the other forms (and with `sweep` other
    tilings of each)."""
    out = {f"shipped {kind} {qtype}": (shipped_gate_up if kind == "gate/up" else shipped_down, {})}
    if kind == "down":
        out["groups down n16 g4 w4"] = (engine_down, {"FORM": "groups", "BLOCK_N": 16, "GROUPS": 4, "num_warps": 4})
    if (kind, qtype) == ("gate/up", "Q4_K"):
        for block_n, warps in ((4, 2), (8, 2), (8, 4), (16, 4), (32, 4), (32, 8)) if sweep else ((8, 4),):
            out[f"q4k combined gate/up n{block_n} w{warps}"] = (q4k_gate_up, {"BLOCK_N": block_n, "num_warps": warps})
    if row_form(qtype) != "halves":
        return out
    launch = engine_gate_up if kind == "gate/up" else engine_down
    for block_n in (8, 16, 32) if sweep else (8,):
        for groups in (2, 4, 8) if sweep else (8,):
            for warps in (2, 4) if sweep else (4,):
                out[f"halves {kind} n{block_n} g{groups} w{warps}"] = (
                    launch, {"FORM": "halves", "BLOCK_N": block_n, "GROUPS": groups, "num_warps": warps})
    return out


def make_stack(qtype: str, shape: tuple, device: str, seed: int) -> QuantizedStack:
    stack = QuantizedStack(qtype, shape, torch.bfloat16).to(device)
    fill_random_blocks(stack.blocks, qtype, shape[-1] ** -0.5, seed=seed)
    return stack


def inputs(rows: int, busy: int, experts: int, hidden: int, inter: int, top_k: int, device: str, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
    ids = torch.rand(rows, experts, generator=g).topk(top_k, dim=-1).indices.to(device, torch.int32)
    weights = torch.rand(rows, top_k, generator=g).softmax(-1).to(device, torch.bfloat16)
    flags = (torch.arange(rows) < busy).to(device, torch.uint8)
    h = torch.randn(rows * top_k, inter, generator=g).to(device, torch.bfloat16)
    return x, ids, weights, flags, h


def compare(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> float:
    got, want = got[rows].float(), want[rows].float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check(device: str) -> None:
    """Each variant against the engine's configuration at small sizes (under the interpreter on a CPU)."""
    experts, hidden, inter, top_k = 6, 512, 64, 2
    x, ids, weights, flags, h_in = inputs(SLOTS, 3, experts, hidden, inter, top_k, device, 0)
    live = flags.repeat_interleave(top_k).bool()
    for kind, qtype in CASES:
        gate_up = kind == "gate/up"
        stack = make_stack(qtype, (experts, 2 * inter, hidden) if gate_up else (experts, hidden, inter), device, 1)
        want = None
        for name, (fn, config) in variants(kind, qtype).items():
            if config.get("num_warps") == 8 or config.get("BLOCK_N") == 32:
                continue
            got = torch.zeros(SLOTS * top_k, inter if gate_up else hidden, device=device,
                              dtype=torch.bfloat16 if gate_up else torch.float32)
            if gate_up:
                fn(x, ids, flags, stack, got, top_k, config)
            else:
                fn(h_in, ids, weights, flags, stack, got, top_k, config)
            want = got if want is None else want
            print(name, compare(got, want, live), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--busy", default="1,4")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also other tilings of each type's form")
    args = parser.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
        return
    from experiment_results import save
    from graph_timing import graph_us
    calls = 16                           # each call's rows pick other experts: the weights stream from memory
    stacks = {case: make_stack(case[1], (EXPERTS, 2 * INTER, HIDDEN) if case[0] == "gate/up" else
                               (EXPERTS, HIDDEN, INTER), "cuda", 1) for case in CASES}
    results = []
    for busy in (int(b) for b in args.busy.split(",")):
        draws = [inputs(SLOTS, busy, EXPERTS, HIDDEN, INTER, TOP_K, "cuda", seed) for seed in range(calls)]
        live = draws[0][3].repeat_interleave(TOP_K).bool()
        distinct = sum(d[1][:busy].unique().numel() for d in draws) / calls
        for (kind, qtype), stack in stacks.items():
            label, table, expert_bytes = f"{kind} {qtype}", variants(kind, qtype, args.sweep), stack.blocks[0].numel()
            is_gate_up = kind == "gate/up"
            outs = [torch.zeros(SLOTS * TOP_K, INTER if is_gate_up else HIDDEN, device="cuda",
                                dtype=torch.bfloat16 if is_gate_up else torch.float32) for _ in range(calls)]

            def call(fn, config, i):
                x, ids, weights, flags, h = draws[i]
                if is_gate_up:
                    fn(x, ids, flags, stack, outs[i], TOP_K, config)
                else:
                    fn(h, ids, weights, flags, stack, outs[i], TOP_K, config)

            entry = {"case": label, "busy": busy, "slots": SLOTS, "distinct_experts": distinct}
            want = None
            for name, (fn, config) in table.items():
                try:
                    call(fn, config, 0)
                    got = outs[0].clone()
                    want = got if want is None else want
                    us = graph_us(lambda i, f=fn, c=config: call(f, c, i), calls=calls, replays=5)
                    entry[name] = {"us": round(us, 2), "GB/s": round(distinct * expert_bytes / us / 1e3, 1),
                                   "max_rel": compare(got, want, live)}
                except Exception as err:  # noqa: BLE001 - report the variant that failed, keep the others
                    entry[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            timed = sorted((v["us"], n) for n, v in entry.items() if isinstance(v, dict) and "us" in v)
            entry["best"] = timed[:4]
            print(json.dumps({k: entry[k] for k in ("case", "busy")} | {"shipped": entry[next(iter(table))],
                                                                          "best": entry["best"]}), flush=True)
            results.append(entry)
            save(args.out, results)


if __name__ == "__main__":
    main()
