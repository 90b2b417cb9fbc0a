"""Ways to multiply a decode step's few rows by a Q8_0 weight, timed side by side on a GPU (an experiment: which
form block_products.py should take).

    python bench/q8_rows_variants.py --out variants.json [--rows 1,4] [--check]

The shipped kernel (block_products.block_row_products) dequantizes each tile in registers and multiplies on the
tensor cores (tl.dot), which needs the tile moved into the MMA's operand layout; a Q8_0 block is 34 bytes, so a
block's quants sit at 2-byte alignment. The variants here change one of the two:

* `dot`: the shipped kernel, its plan;
* `fma`: the same 34-byte blocks, the product as broadcast multiplies and a sum over the tile (CUDA cores, no
  operand layout);
* `split fma` / `split dot`: each row's blocks regrouped as all their float16 scales, then all their quants (the same
  bytes; a row of the model's widths stays a multiple of 16 bytes, so the quants load as 16-byte vectors), with either
  product; `split dot` is the engine's Q8_0_R path since it measured fastest (block_products; the regroup at load is
  quantized.regroup_q8_0), at 1, 2 and 4 pipeline stages;
* `twin`: the bfloat16 twin (twice the bytes) through row_products.py's plan and through the FMA form.

Every variant multiplies the values the shipped kernel multiplies (d x q rounded to x's dtype) and sums in float32;
a row's sum never reads another row. `--check` compares each with the shipped kernel (the largest difference; the
sums' order differs between the tensor-core and the FMA forms) and runs under TRITON_INTERPRET=1 on a CPU.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.engine.model.quant_blocks import split_q8_0
from qwen4exp.kernels import block_products, row_products
from qwen4exp.kernels.guard import interpreted
from qwen4exp.kernels.quant_tiles import dequantize_groups, dequantize_rows
from qwen4exp.kernels.rounding import finish_parts, part_counts, round_to

SHAPES = [(248320, 2560), (16480, 2560), (2560, 6144), (2560, 2560), (324, 10240), (12288, 2560), (1024, 2560),
          (2560, 640)]
L2_BYTES = 256 << 20


@triton.jit(do_not_specialize=["rows", "n"])   # as the shipped kernel
def _fma_kernel(x_ptr, w_ptr, out_ptr, parts_ptr, counts_ptr, rows, n, k, x_stride, row_bytes, part_k, quants_at,
                INTERPRETED: tl.constexpr, LAYOUT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """out[:, block] = x @ w[block].T as float32 multiply-adds: for each tile, x [M, 1, K] x w [1, N, K] summed
    over K."""
    block = tl.program_id(0)
    part = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    feats = block * BLOCK_N + tl.arange(0, BLOCK_N)
    f_ok = feats < n
    row = w_ptr + feats.to(tl.int64) * row_bytes
    ks = tl.arange(0, BLOCK_K)
    groups: tl.constexpr = BLOCK_K // 32
    begin = part * part_k
    end = tl.minimum(begin + part_k, k)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(begin, end, BLOCK_K):
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_stride + start + ks[None, :],
                    mask=(m < rows)[:, None] & (start + ks < end)[None, :], other=0.0)
        if LAYOUT == 2:                       # the bfloat16 twin, [N, K] elements
            w = tl.load(w_ptr + feats.to(tl.int64)[:, None] * k + start + ks[None, :],
                        mask=f_ok[:, None] & (start + ks < end)[None, :], other=0.0).to(tl.float32)
        elif LAYOUT == 1:
            q = tl.load(row[:, None] + quants_at + start + ks[None, :],
                        mask=f_ok[:, None] & (start + ks < end)[None, :], other=0)
            q = q.to(tl.int8, bitcast=True).to(tl.float32)
            g = tl.arange(0, groups)
            s = tl.load(row.to(tl.pointer_type(tl.float16))[:, None] + start // 32 + g[None, :],
                        mask=f_ok[:, None] & (start + g * 32 < end)[None, :], other=0.0).to(tl.float32)
            w = tl.reshape(tl.reshape(q, [BLOCK_N, groups, 32]) * s[:, :, None], [BLOCK_N, BLOCK_K])
        else:
            col = start + (tl.arange(0, groups) * 32)[None, :, None]
            lane = tl.arange(0, 32)[None, None, :]
            w = tl.reshape(dequantize_groups(row[:, None, None], col, lane, (col < end) & f_ok[:, None, None], w_ptr,
                                             "Q8_0"), [BLOCK_N, BLOCK_K])
        w = round_to(w, x_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    offsets = m[:, None].to(tl.int64) * n + feats[None, :]
    ok = (m < rows)[:, None] & f_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offsets, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)
    else:
        finish_parts(acc, out_ptr, parts_ptr, counts_ptr, offsets, ok, block, part, rows * n, SPLIT, 1, INTERPRETED)


def launch(kernel, x, w, n, k, config: dict, **flags) -> torch.Tensor:
    rows = x.shape[0]
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    config = dict(config)
    split = config.pop("SPLIT_K")
    part_k = triton.cdiv(triton.cdiv(k, split), config["BLOCK_K"]) * config["BLOCK_K"]
    parts_n = triton.cdiv(k, part_k)
    parts = torch.empty(parts_n, rows, n, device=x.device, dtype=torch.float32) if parts_n > 1 else out
    block_m = config.pop("BLOCK_M", 16)
    # The quants' offset in a split row is an argument, so Triton sees when it is a multiple of 16 (loads in vectors).
    grid = (triton.cdiv(n, config["BLOCK_N"]), parts_n)
    kernel[grid](x, w, out, parts, part_counts(x.device, grid), rows, n, k, x.stride(0), w.shape[1], part_k, k // 16,
                 BLOCK_M=block_m, SPLIT=parts_n, **flags, **config)
    return out


def variants(n: int, k: int, rows: int) -> dict[str, tuple]:
    """name -> (kernel or None for the shipped one, layout, config)."""
    planned = block_products.plan(n, k)
    block_m = max(1, triton.next_power_of_2(rows))
    out = {"dot (shipped plan)": (None, "blocks", planned)}
    for block_n in (16, 32, 64):
        for block_k in (128, 256):
            for split_mul in (1, 2):
                config = {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": planned["SPLIT_K"] * split_mul,
                          "BLOCK_M": block_m, "num_warps": 4, "num_stages": 2}
                tag = f"n{block_n} k{block_k} split{config['SPLIT_K']}"
                out[f"fma {tag}"] = (_fma_kernel, "blocks", config)
                out[f"split fma {tag}"] = (_fma_kernel, "split", config)
    out["twin: row_products plan"] = ("twin", "twin", None)
    for block_n in (16, 32):
        for split_mul in (1, 2):
            config = {"BLOCK_N": block_n, "BLOCK_K": 128, "SPLIT_K": planned["SPLIT_K"] * split_mul,
                      "BLOCK_M": block_m, "num_warps": 4, "num_stages": 2}
            out[f"twin fma n{block_n} k128 split{config['SPLIT_K']}"] = (_fma_kernel, "twin", config)
    for stages in (1, 2, 4):                 # the engine's own Q8_0_R path (block_products), at each pipeline depth
        out[f"split dot stages{stages}"] = ("Q8_0_R", "split", planned | {"num_stages": stages})
    return out


def run(kernel, layout, config, x, blocks, split, twin, n, k):
    if kernel is None:
        return block_products.block_row_products(x, blocks, "Q8_0", dict(config))
    if kernel == "twin":
        return row_products.row_products(x, twin)
    if kernel == "Q8_0_R":
        return block_products.block_row_products(x, split, "Q8_0_R", dict(config))
    weight = {"split": split, "blocks": blocks, "twin": twin}[layout]
    flags = {"INTERPRETED": interpreted(x), "LAYOUT": ("blocks", "split", "twin").index(layout)}
    return launch(kernel, x, weight, n, k, config, **flags)


def check(device: str) -> None:
    """Each variant against the shipped kernel on a small weight (under the interpreter on a CPU)."""
    n, k = 40, 640
    blocks = torch.empty(n, k // 32 * 34, dtype=torch.uint8, device=device)
    fill_random_blocks(blocks, "Q8_0", 0.02, seed=1)
    split = split_q8_0(blocks)
    twin = dequantize_rows(blocks, "Q8_0").to(torch.bfloat16)
    for rows in (1, 3):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        want = block_products.block_row_products(x, blocks, "Q8_0").float()
        for name, (kernel, layout, config) in variants(n, k, rows).items():
            if "k256" in name or "stages4" in name:
                continue
            got = run(kernel, layout, config, x, blocks, split, twin, n, k).float()
            print(rows, name, (got - want).abs().max().item(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
        return
    from experiment_results import save
    from graph_timing import graph_us
    results = []
    for n, k in SHAPES:
        nbytes = n * k // 32 * 34
        copies = max(1, min(64, -(-L2_BYTES // nbytes)))
        stacks = []
        for i in range(copies):
            blocks = torch.empty(n, k // 32 * 34, dtype=torch.uint8, device="cuda")
            fill_random_blocks(blocks, "Q8_0", 0.02, seed=i)
            stacks.append((blocks, split_q8_0(blocks), dequantize_rows(blocks, "Q8_0").to(torch.bfloat16)))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            want = block_products.block_row_products(x, stacks[0][0], "Q8_0").float()
            entry = {"shape": [n, k], "rows": rows, "MB": round(nbytes / 1e6, 1)}
            for name, (kernel, layout, config) in variants(n, k, rows).items():
                try:
                    def fn(i, c=config, kn=kernel, la=layout, st=stacks):
                        return run(kn, la, c, x, *st[i], n, k)
                    diff = (fn(0).float() - want).abs().max().item()
                    us = graph_us(fn, calls=copies, replays=3)
                    entry[name] = {"us": round(us, 2), "TB/s": round(nbytes / us / 1e6, 2), "max_diff": diff}
                except Exception as err:  # noqa: BLE001 - report the variant that failed, keep the others
                    entry[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            timed = sorted((v["us"], name) for name, v in entry.items() if isinstance(v, dict) and "us" in v)
            entry["best"] = timed[:5]
            print(json.dumps({"shape": entry["shape"], "rows": rows, "shipped": entry["dot (shipped plan)"],
                              "best": entry["best"]}), flush=True)
            results.append(entry)
            save(args.out, results)


if __name__ == "__main__":
    main()
