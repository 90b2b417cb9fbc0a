"""How many kernels a decode step launches, and where, counted on the CPU machine without a GPU.

    python bench/launch_census.py [--preset full] [--layers N] [--quant ud-q4_k_xl] [--rows 1 | --chunk 128]
        [--substeps 4] [--top 40]

The model is built on the meta device for a CUDA target (kernel_launches' way: the Triton backend, no memory),
one decode step of `--rows` rows runs (or a verify step of `--substeps` positions a row), and every Triton launch
and every torch operator that would launch a kernel on the GPU (not views, not allocations) is counted, each under
the layer kind and the ops-backend method it ran in. A replayed CUDA graph runs exactly these kernels, so the
census is the step's kernel count that bench/decode_trace.py measures on the GPU (up to torch operators whose CUDA
form launches more than one kernel, or none), at a fraction of a lease: where the small kernels of a step come
from, before fusing them.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen4exp.checkpoint.presets import preset_config
from qwen4exp.engine.model import kernel_launches
from qwen4exp.engine.model.causal_lm import Qwen4ExpForCausalLM
from qwen4exp.engine.model.config import ModelConfig
from qwen4exp.engine.model.quantized import keep_quantized, regroup_q8_0
from qwen4exp.engine.model.triton_ops import TritonOps
from qwen4exp.engine.state import StateBatch
from qwen4exp.kernels import ahead_of_time, guard

# Operators that launch no kernel on a GPU: allocations (uninitialised) and metadata.
NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "alias",
             "lift_fresh", "_local_scalar_dense", "set_", "resize_", "record_stream"}


def where_am_i() -> tuple[str, str]:
    """(the layer kind, the ops-backend method) of the innermost frames that name them."""
    kind, method = "model", "model"
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if method == "model" and isinstance(owner, TritonOps) and not frame.f_code.co_name.startswith("_"):
            method = frame.f_code.co_name
        if kind == "model" and isinstance(owner, torch.nn.Module) and frame.f_code.co_name == "forward" \
                and type(owner).__name__ != "Qwen4ExpForCausalLM":
            kind = type(owner).__name__
        frame = frame.f_back
    return kind, method


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in NO_KERNEL:
            kind, method = where_am_i()
            self.ops[(kind, method, name)] += 1
        return func(*args, **(kwargs or {}))


def census(config: ModelConfig, quantized: dict, rows: int, target: guard.Target, chunk: int = 0,
           substeps: int = 1) -> dict:
    device = torch.device("meta")
    with guard.compiling_for(target), ahead_of_time.recording(where_am_i_label) as launches:
        with device:
            model = Qwen4ExpForCausalLM(config)
            keep_quantized(model, quantized, kernel_launches.DTYPE)
            regroup_q8_0(model)
            model = model.to(kernel_launches.DTYPE)
        model.ops = kernel_launches.OwnKernels()
        states = StateBatch(config, rows, kernel_launches.CAPACITY, device, kernel_launches.DTYPE)
        if substeps > 1:
            states.allocate_history(substeps - 1)
        rope = model.rope_table(kernel_launches.CAPACITY, device)
        ids = torch.zeros(rows * substeps, dtype=torch.long, device=device)
        active = torch.ones(rows * substeps, dtype=torch.bool, device=device)
        start = len(launches)
        with Census() as counted:
            if chunk:
                model(torch.zeros(chunk, dtype=torch.long, device=device), states.rows[0])
            else:
                model.verify_rows(ids, ids, active, states, rope, substeps)
        step = launches[start:]
    triton = collections.Counter((launch.op.split("|")[0], launch.op.split("|")[1], launch.name) for launch in step)
    return {"triton": triton, "torch": counted.ops}


def where_am_i_label() -> str:
    return "|".join(where_am_i())


def report(result: dict, top: int) -> dict:
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for source in ("triton", "torch"):
        for (kind, _, _), n in result[source].items():
            by_kind[kind][source] += n
    total = {source: sum(result[source].values()) for source in ("triton", "torch")}
    print(f"kernels a step: {total['triton'] + total['torch']} ({total['triton']} Triton, {total['torch']} torch)")
    print("\nby layer kind            Triton   torch")
    for kind, counts in sorted(by_kind.items(), key=lambda item: -sum(item[1].values())):
        print(f"  {kind:22s} {counts['triton']:6d}  {counts['torch']:6d}")
    print(f"\nthe {top} most launched (kind, ops method, kernel or operator)")
    merged = [(n, "triton", key) for key, n in result["triton"].items()] + \
             [(n, "torch", key) for key, n in result["torch"].items()]
    for n, source, (kind, method, name) in sorted(merged, reverse=True)[:top]:
        print(f"  {n:5d}  {source:6s} {kind:22s} {method:22s} {name}")
    return {"total": total, "by_kind": {k: dict(v) for k, v in by_kind.items()},
            "launches": [{"count": n, "source": s, "kind": k, "method": m, "name": name}
                         for n, s, (k, m, name) in sorted(merged, reverse=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="full", choices=("tiny", "bench", "full"))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--quant", default="ud-q4_k_xl", help="a GGUF mix or block type; 'none' for bfloat16")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=0, help="count a prompt chunk of this many tokens instead "
                        "(at the prompt's start; eager, as the engine runs prompt chunks)")
    parser.add_argument("--substeps", type=int, default=1, help="count a verify step of this many positions a row "
                        "(speculative decoding: 1 + the drafts) instead of a plain decode step")
    parser.add_argument("--target", default="sm_90", help="one of " + ", ".join(guard.CHECKED_TARGETS))
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default=None, help="also write the counts as JSON")
    args = parser.parse_args()
    config = ModelConfig.from_dict(preset_config(args.preset, args.layers, dtype="bfloat16"), source=args.preset)
    quantized = {} if args.quant == "none" else kernel_launches.quantized_for(config, args.quant)
    result = report(census(config, quantized, args.rows, guard.CHECKED_TARGETS[args.target], args.chunk,
                            args.substeps), args.top)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "layers": config.num_hidden_layers, "quant": args.quant,
                       "rows": args.rows, "target": args.target, **result}, f, indent=1)


if __name__ == "__main__":
    main()
