"""Ways to run a decode step's routed experts over GGML blocks, timed side by side on a GPU (an experiment: which
form kernels/moe_blocks.py's row kernels should take).

    python bench/moe_rows_variants.py --out variants.json [--busy 1,4]      # a GPU
    python bench/moe_rows_variants.py --sweep --out variants.json            # and other tilings
    python bench/moe_rows_variants.py --fp8 --out variants.json              # an FP8 checkpoint's experts
    TRITON_INTERPRET=1 python bench/moe_rows_variants.py --check            # each variant against the shipped one

The engine's down kernel (moe_blocks.rows_down) reads a row of a 32-value type (Q5_1, Q8_0) a few blocks a step,
each as two runs of 16 values (quant_tiles.row_form's `halves`: a Q5_1 block's 16 quant bytes and its fifth bits, a
Q8_0 block's quants as 16 two-byte words, since a 34-byte block is only 2-byte aligned); its gate/up kernel reads
Q4_K a 256-value block a step, gate and up in one loop (the form this bench timed as `q4k combined` before the
engine took it), the other types a byte a value, gate and up each in a pass of their own. `groups` is the
byte-a-value form (quant_tiles.dequantize_groups, whose addresses Triton cannot prove aligned) that all types had
before: for down, and for gate/up over Q4_K the engine's form before. The halves form is also tried for gate/up
over Q8_0. `--sweep` times each at other tilings: N rows a program, G blocks a step, W warps.

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

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe_blocks
from qwen4exp.kernels.guard import interpreted
from qwen4exp.kernels.quant_tiles import grid_for, row_form

EXPERTS, HIDDEN, INTER, TOP_K, SLOTS = 512, 2560, 640, 10, 4
# (product, type): UD-Q4_K_XL's gate/up and its two down types, and Q8_0 gate/up (the q8_0 mix)
CASES = [("gate/up", "Q4_K"), ("down", "Q5_1"), ("down", "Q8_0"), ("gate/up", "Q8_0")]
FP8_CASES = [("gate/up", "FP8_B128"), ("down", "FP8_B128")]       # an FP8 checkpoint's experts (--fp8)


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
    if (kind, qtype) in (("gate/up", "Q4_K"), ("gate/up", "FP8_B128")):
        out["groups gate/up n8 g16 w4"] = (engine_gate_up, {"FORM": "groups", "BLOCK_N": 8, "GROUPS": 16,
                                                            "num_warps": 4})
    form = row_form(qtype)
    if form not in ("halves", "words"):
        return out
    launch = engine_gate_up if kind == "gate/up" else engine_down
    for block_n in (8, 16, 32) if sweep else (8,):
        for groups in (2, 4, 8) if sweep else (8,):
            for warps in (2, 4) if sweep else (4,):
                out[f"{form} {kind} n{block_n} g{groups} w{warps}"] = (
                    launch, {"FORM": form, "BLOCK_N": block_n, "GROUPS": groups, "num_warps": warps})
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
    experts, hidden, inter, top_k = 6, 512, 128, 2
    x, ids, weights, flags, h_in = inputs(SLOTS, 3, experts, hidden, inter, top_k, device, 0)
    live = flags.repeat_interleave(top_k).bool()
    for kind, qtype in CASES + FP8_CASES:
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
    parser.add_argument("--fp8", action="store_true", help="FP8_B128 experts (an FP8 checkpoint's) in place of GGUF's")
    args = parser.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
        return
    from experiment_results import save
    from graph_timing import graph_us
    calls = 16                           # each call's rows pick other experts: the weights stream from memory
    stacks = {case: make_stack(case[1], (EXPERTS, 2 * INTER, HIDDEN) if case[0] == "gate/up" else
                               (EXPERTS, HIDDEN, INTER), "cuda", 1) for case in (FP8_CASES if args.fp8 else CASES)}
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
