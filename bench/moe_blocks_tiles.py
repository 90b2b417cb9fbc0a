"""A prompt chunk's routed experts over quantized stacks at the full model's shapes (512 experts, 2560 -> 2 x 640,
top-10; gate/up Q4_K and down Q5_1 or Q8_0 as in the UD-Q4_K_XL mix), moe.moe_grouped in each form it can take
(kernels/moe.py's GroupedForm): small row blocks, full row blocks with the tiles dequantized in the GEMMs, the
stacks dequantized whole first. Per chunk length: each form's time (median of triton.testing.do_bench, L2 flushed,
ms, the whole op: both GEMMs and the slot sum) and whether the forms give the same rows bit for bit (they need not:
the engine batches chunks only within one form). The form the engine picks at each length is marked.

    python bench/moe_blocks_tiles.py --rows 128,512,1024,2048,4096 --out tiles.json       # needs Triton and a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe

EXPERTS, HIDDEN, INTER, TOP_K = 512, 2560, 640, 10
FORMS = {"small row blocks": moe.GroupedForm(moe.SMALL_BLOCK_M, False, False),
         "full row blocks": moe.GroupedForm(moe.GROUPED_BLOCK_M, False, False),
         "dequantized whole": moe.GroupedForm(moe.GROUPED_BLOCK_M, True, True)}


def stack(qtype: str, shape: tuple[int, ...], seed: int, device) -> QuantizedStack:
    made = QuantizedStack(qtype, shape, torch.bfloat16).to(device)
    fill_random_blocks(made.blocks, qtype, shape[-1] ** -0.5, seed=seed)
    return made


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="128,512,1024,2048,4096")
    parser.add_argument("--gate-up", default="Q4_K")
    parser.add_argument("--down", default="Q5_1,Q8_0")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    gate_up = stack(args.gate_up, (EXPERTS, 2 * INTER, HIDDEN), 1, device)
    results = {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "device_name": torch.cuda.get_device_name(device), "shapes": [EXPERTS, HIDDEN, INTER, TOP_K],
               "small_below_pairs_an_expert": moe.SMALL_BELOW, "runs": []}
    for down_type in args.down.split(","):
        down = stack(down_type, (EXPERTS, HIDDEN, INTER), 2, device)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
            ids = torch.rand(rows, EXPERTS, device=device).topk(TOP_K, dim=-1).indices
            weights = torch.rand(rows, TOP_K, device=device).softmax(-1).to(torch.bfloat16)
            chosen = moe.grouped_form(gate_up, down, rows * TOP_K)
            run = {"gate_up": args.gate_up, "down": down_type, "rows": rows, "ms": {}, "chosen": None}
            outputs = {}
            for name, form in FORMS.items():
                outputs[name] = moe.moe_grouped(x, ids, weights, gate_up, down, form=form)
                run["ms"][name] = triton.testing.do_bench(
                    lambda form=form: moe.moe_grouped(x, ids, weights, gate_up, down, form=form))
                if form == chosen:
                    run["chosen"] = name
            first = outputs["small row blocks"]
            run["same_rows_as_small"] = {name: bool(torch.equal(out, first)) for name, out in outputs.items()}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
