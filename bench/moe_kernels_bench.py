"""The routed-expert kernels on the GPU at the bench preset's shapes: each kernel against moe.py's torch path
(errors), the contracts the engine relies on (determinism, row independence, CUDA-graph replay, idle rows), and
median timings from triton.testing.do_bench (L2 flushed between runs).

    python bench/moe_kernels_bench.py          # needs Triton and a CUDA/ROCm device
"""

from __future__ import annotations

from functools import partial

import torch
import triton

from qwen4exp.engine.model.moe import Experts, experts_grouped, experts_per_row
from qwen4exp.kernels import guard
from qwen4exp.kernels.moe import (GROUPED_BLOCK_M, GROUPED_DOWN, GROUPED_GATE_UP, ROWS_DOWN, ROWS_GATE_UP,
                                  moe_grouped, moe_rows)


def bench() -> None:
    experts_n, hidden, inter, top_k = 512, 2560, 640, 10
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            experts = Experts(experts_n, hidden, inter)
    finally:
        torch.set_default_dtype(default_dtype)
    experts.requires_grad_(False)
    experts.gate_up_proj.normal_(0.0, hidden ** -0.5)
    experts.down_proj.normal_(0.0, inter ** -0.5)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()

    def routing(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, hidden, device=device, dtype=dtype)
        probs, ids = torch.rand(rows, experts_n, device=device).topk(top_k, dim=-1)
        return x, ids, (probs / probs.sum(-1, keepdim=True)).to(dtype)

    def errors(got: torch.Tensor, want: torch.Tensor) -> str:
        diff = (got.float() - want.float()).abs().max().item()
        rel = diff / want.float().abs().max().item()
        return f"max abs err {diff:.3e}, rel {rel:.3e}"

    print(f"moe_rows: E={experts_n} H={hidden} I={inter} k={top_k} bf16, configs {ROWS_GATE_UP} {ROWS_DOWN}")
    for rows in (1, 2, 4):
        x, ids, weights = routing(rows)
        got = moe_rows(x, ids, weights, gate_up, down)
        want = experts_per_row(x, ids, weights, gate_up, down)
        again = moe_rows(x, ids, weights, gate_up, down)
        ms = triton.testing.do_bench(partial(moe_rows, x, ids, weights, gate_up, down), return_mode="median")
        torch_ms = triton.testing.do_bench(partial(experts_per_row, x, ids, weights, gate_up, down),
                                           return_mode="median")
        moved = torch.unique(ids).numel() * expert_bytes + 2 * x.numel() * x.element_size()
        print(f"  T={rows}: {errors(got, want)}; deterministic {torch.equal(got, again)}; "
              f"{ms * 1e3:.1f} us = {moved / ms / 1e6:.0f} GB/s (torch bmm path {torch_ms * 1e3:.0f} us)")

    rows = 4
    x, ids, weights = routing(rows)
    active = torch.tensor([True, False, True, True], device=device)
    base = moe_rows(x, ids, weights, gate_up, down, active)
    other_x, other_ids, other_weights = routing(rows)
    other_x[0], other_ids[0], other_weights[0] = x[0], ids[0], weights[0]
    other = moe_rows(other_x, other_ids, other_weights, gate_up, down, active)
    print(f"  idle row is zero: {bool((base[1] == 0).all())}; row 0 independent of rows 1..3: "
          f"{torch.equal(base[0], other[0])}")
    static = [t.clone() for t in (x, ids, weights)]
    graph = torch.cuda.CUDAGraph()
    moe_rows(*static, gate_up, down, active)  # compiled before the capture
    with torch.cuda.graph(graph):
        captured = moe_rows(*static, gate_up, down, active)
    for buffer, value in zip(static, (other_x, other_ids, other_weights), strict=True):
        buffer.copy_(value)
    graph.replay()
    print(f"  CUDA graph replay equals eager: {torch.equal(captured, other)}")

    print(f"moe_grouped: BLOCK_M={GROUPED_BLOCK_M}, configs {GROUPED_GATE_UP} {GROUPED_DOWN}")
    for rows in (4096, 16384):
        x, ids, weights = routing(rows)
        got = moe_grouped(x, ids, weights, gate_up, down)
        want = experts_grouped(x, ids, weights, gate_up, down)
        again = moe_grouped(x, ids, weights, gate_up, down)
        head = moe_grouped(x[:100], ids[:100], weights[:100], gate_up, down)
        ms = triton.testing.do_bench(partial(moe_grouped, x, ids, weights, gate_up, down), return_mode="median")
        torch_ms = triton.testing.do_bench(partial(experts_grouped, x, ids, weights, gate_up, down), rep=200,
                                           return_mode="median")
        flops = 2 * rows * top_k * 3 * hidden * inter
        print(f"  T={rows}: {errors(got, want)}; deterministic {torch.equal(got, again)}; "
              f"batch-invariant {torch.equal(head, got[:100])}; {ms:.2f} ms = {flops / ms / 1e9:.0f} TFLOP/s "
              f"(torch loop {torch_ms:.1f} ms)")
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    if guard.triton is None or not torch.cuda.is_available():
        raise SystemExit("the benchmark needs Triton and a CUDA/ROCm device")
    bench()
