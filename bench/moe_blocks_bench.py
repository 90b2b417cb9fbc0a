"""The routed-expert kernels over GGML blocks (kernels/moe_blocks.py) against the dense bfloat16 kernels, at the
full model's expert shapes (512 experts, 2560 x 640, top-10): decode rows (bytes of the distinct experts read per
second) and a prefill chunk (TFLOP/s of the products), medians from triton.testing.do_bench (L2 flushed).

    python bench/moe_blocks_bench.py --out results.json      # needs Triton and a CUDA/ROCm device
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels.moe import moe_grouped, moe_rows

EXPERTS, HIDDEN, INTER, TOP_K = 512, 2560, 640, 10
# (gate/up, down): the UD-Q4_K_XL mix's two layer kinds, Q8_0 throughout, and bfloat16 as the dense reference
PAIRS = [("Q4_K", "Q5_1"), ("Q4_K", "Q8_0"), ("Q8_0", "Q8_0"), ("BF16", "BF16")]


def stack(qtype: str, shape: tuple[int, int, int], device: torch.device):
    if qtype == "BF16":
        return torch.randn(shape, device=device, dtype=torch.bfloat16) * shape[-1] ** -0.5
    blocks = QuantizedStack(qtype, shape, torch.bfloat16).to(device)
    fill_random_blocks(blocks.blocks, qtype, shape[-1] ** -0.5, seed=1)
    return blocks


def nbytes(weights) -> int:
    return weights.blocks.numel() if isinstance(weights, QuantizedStack) else weights.numel() * weights.element_size()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--chunk", type=int, default=4096)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "device_name": torch.cuda.get_device_name(device), "shapes": [EXPERTS, HIDDEN, INTER, TOP_K],
               "runs": []}
    for gate_up_type, down_type in PAIRS:
        gate_up = stack(gate_up_type, (EXPERTS, 2 * INTER, HIDDEN), device)
        down = stack(down_type, (EXPERTS, HIDDEN, INTER), device)
        per_expert = (nbytes(gate_up) + nbytes(down)) / EXPERTS
        for rows in [int(r) for r in args.rows.split(",")] + [args.chunk]:
            x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
            ids = torch.rand(rows, EXPERTS, device=device).topk(TOP_K, dim=-1).indices
            weights = torch.rand(rows, TOP_K, device=device).softmax(-1).to(torch.bfloat16)
            kernel = moe_rows if rows <= 16 else moe_grouped
            ms = triton.testing.do_bench(lambda: kernel(x, ids, weights, gate_up, down))
            distinct = ids.unique().numel()
            run = {"gate_up": gate_up_type, "down": down_type, "rows": rows, "kernel": kernel.__name__, "ms": ms,
                   "distinct_experts": distinct, "weight_bytes": distinct * per_expert}
            run["weight_gb_per_s"] = run["weight_bytes"] / ms / 1e6
            run["tflops"] = 2 * 3 * rows * TOP_K * HIDDEN * INTER / ms / 1e9
            results["runs"].append(run)
            print(f"{gate_up_type:5}/{down_type:5} rows {rows:5} {kernel.__name__:12} {ms:8.3f} ms  "
                  f"{run['weight_gb_per_s']:7.0f} GB/s of weights  {run['tflops']:6.1f} TFLOP/s", flush=True)
        gate_up = down = None     # freed before the next pair's stacks
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
