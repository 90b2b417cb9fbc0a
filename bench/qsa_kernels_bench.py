"""Time QSA's kernels (kernels/qsa_attention.py) against the torch forms at the shipped sizes on a GPU.

    python bench/qsa_kernels_bench.py --out qsa.json

Shipped sizes: 24 query heads over 2 K/V heads of 256; an indexer of 4 heads of 128 over blocks of 4 tokens,
512 blocks kept per query. For a 4096-query prompt chunk after 12K and 60K tokens: the block ranking (kernel
+ top-k against einsum + stable sort) and attention (sparse over each query's 2052 listed tokens against
dense SDPA under the [chunk, prefix] mask), with a few tile shapes. For a decode step of 1 and 4 rows at a
20K and a 68K context: the ranking over the whole capacity and the attention with several list splits.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from graph_timing import graph_us
from qwen4exp.kernels import qsa_attention as qsa_kernels
from qwen4exp.engine.model.qsa import token_lists

HEADS, KV, DIM, INDEX_HEADS, INDEX_DIM, RATIO, TOPK = 24, 2, 256, 4, 128, 4, 512
TILES = [(64, 4), (32, 4), (64, 8), (128, 8)]          # (ATTEND_TOKENS, ATTEND_WARPS)


def time_ms(fn, reps: int = 5) -> float:
    """Eager GPU time per call (prompt-sized calls: launch overhead is noise here)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / reps, 3)


def with_tiles(tokens: int, warps: int, fn):
    saved = qsa_kernels.ATTEND_TOKENS, qsa_kernels.ATTEND_WARPS
    qsa_kernels.ATTEND_TOKENS, qsa_kernels.ATTEND_WARPS = tokens, warps
    try:
        return fn()
    finally:
        qsa_kernels.ATTEND_TOKENS, qsa_kernels.ATTEND_WARPS = saved


def prefill(prefix: int, n: int, gen: torch.Generator) -> dict:
    end = prefix + n
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(n, HEADS, DIM, generator=gen).to(dev, bf16)
    keys, values = (torch.randn(KV, end, DIM, generator=gen).to(dev, bf16) for _ in range(2))
    index_q = torch.randn(n, INDEX_HEADS, INDEX_DIM, generator=gen).to(dev, bf16)
    blocks = torch.randn(end // RATIO, INDEX_DIM, generator=gen).to(dev, bf16)
    positions = torch.arange(prefix, end, device=dev)
    complete = (positions + 1) // RATIO

    def rank_kernel():
        ranked = qsa_kernels.rank_blocks(index_q, blocks, complete)
        return ranked.topk(TOPK, dim=-1, sorted=False).indices.sort(dim=-1).values

    def rank_torch():
        scores = torch.einsum("nhd,bd->nbh", index_q.float(), blocks.float()).relu_().sum(-1) / math.sqrt(INDEX_DIM)
        scores.masked_fill_(torch.arange(blocks.shape[0], device=dev)[None, :] >= complete[:, None], float("-inf"))
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :TOPK]

    index, valid = token_lists(rank_kernel(), complete, positions, RATIO, end)
    mask = torch.zeros(n, end, dtype=torch.bool, device=dev)
    mask[torch.arange(n, device=dev)[:, None].expand_as(index)[valid], index[valid]] = True
    groups = HEADS // KV

    def dense():
        grouped = q.transpose(0, 1).reshape(KV, groups, n, DIM)
        return F.scaled_dot_product_attention(grouped, keys[:, None].expand(-1, groups, -1, -1),
                                              values[:, None].expand(-1, groups, -1, -1), attn_mask=mask[None, None],
                                              scale=DIM ** -0.5)

    result = {"rank kernel + topk ms": time_ms(rank_kernel), "rank einsum + stable sort ms": time_ms(rank_torch),
              "dense SDPA under the mask ms": time_ms(dense)}
    want = dense().reshape(HEADS, n, DIM).transpose(0, 1).float()
    for tokens, warps in TILES:
        def sparse():
            return qsa_kernels.sparse_attention(q, keys, values, index, valid, DIM ** -0.5)
        result[f"sparse {tokens} tokens {warps} warps ms"] = with_tiles(tokens, warps, lambda: time_ms(sparse))
        got = with_tiles(tokens, warps, sparse).float()
        result[f"sparse {tokens} tokens {warps} warps max diff to dense"] = (got - want).abs().max().item()
    return result


def decode(rows: int, capacity: int, length: int, gen: torch.Generator) -> dict:
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(dev, bf16)
    keys, values = (torch.randn(rows, KV, capacity, DIM, generator=gen).to(dev, bf16) for _ in range(2))
    index_q = torch.randn(rows, INDEX_HEADS, INDEX_DIM, generator=gen).to(dev, bf16)
    blocks = torch.randn(rows, capacity // RATIO, INDEX_DIM, generator=gen).to(dev, bf16)
    positions = torch.full((rows,), length - 1, device=dev)
    complete = (positions + 1) // RATIO

    def rank():
        ranked = qsa_kernels.rank_blocks(index_q, blocks, complete)
        return ranked.topk(TOPK, dim=-1, sorted=False).indices.sort(dim=-1).values

    index, valid = token_lists(rank(), complete, positions, RATIO, capacity)
    result = {"rank kernel + topk us": round(graph_us(lambda _: rank()), 1)}
    for splits in (1, 4, 8, 16):
        result[f"attention {splits} splits us"] = round(graph_us(
            lambda _, s=splits: qsa_kernels.sparse_attention(q, keys, values, index, valid, DIM ** -0.5, splits=s)), 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for prefix in (12288, 61440):
        report[f"prefill 4096 queries after {prefix}"] = prefill(prefix, 4096, gen)
        print(json.dumps(report[f"prefill 4096 queries after {prefix}"]), flush=True)
    for rows in (1, 4):
        for capacity, length in ((20480, 16384), (69632, 16384), (69632, 65536)):
            name = f"decode {rows} rows, capacity {capacity}, length {length}"
            report[name] = decode(rows, capacity, length, gen)
            print(name, json.dumps(report[name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
